"""bench.lm_eval_quant: the float32 model it writes for an online quantization holds the weights
qrt's quantized model computes with, and the bench runs end to end on the tiny chat model."""

import json

import pytest
import torch
from helpers.checkpoints.tiny import make_checkpoint
from safetensors.torch import load_file

from bench import lm_eval_quant
from qrt import runtime

# Each quantized layer of the loaded model, fed the identity, returns its dequantized weight W^T,
# rounded once to the model's bf16; the fp8 formats' per-token activation scale is exact on a row
# holding a single 1. So the two agree to bf16's rounding, a relative 2**-8.
BF16_ROUNDING = 2.0 ** -8


def loaded_weight(layer, k: int) -> torch.Tensor:
    """The weight a quantized Linear computes with, as fp32 [N, K]: its output on the identity."""
    with torch.no_grad():
        return layer(torch.eye(k, dtype=torch.bfloat16)).float().t()


@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_the_float32_model_holds_the_weights_qrt_quantizes_to(quant, tmp_path):
    checkpoint = tmp_path / "bf16"
    make_checkpoint(checkpoint, dtype=torch.bfloat16, tie=True)  # tied, as the default model
    folder = lm_eval_quant.write_float32_model(checkpoint, quant, tmp_path / f"float32-{quant}")
    written = load_file(folder / "model.safetensors")
    original = load_file(checkpoint / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in written.values())
    assert not json.loads((folder / "config.json").read_text())["tie_word_embeddings"]
    model = runtime.compile_model(checkpoint, quant, compile=False, progress=False, max_seq_len=64)
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "self_attn.o_proj": ("self_attn.o_proj",),
             "mlp.down_proj": ("mlp.down_proj",)}
    checked = 0
    for i, decoder in enumerate(model.model.model.layers):
        for name, parts in fused.items():
            layer = decoder.get_submodule(name)
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            ours = torch.cat([written[n] for n in names])  # [N, K] fp32
            theirs = loaded_weight(layer, ours.shape[1])
            scale = ours.abs().max()
            assert (theirs - ours).abs().max() <= BF16_ROUNDING * scale, f"{quant} {name} of layer {i}"
            # The check tells quantized weights from the checkpoint's: those are further away.
            stored = torch.cat([original[n].float() for n in names])
            assert (theirs - stored).abs().max() > 4 * BF16_ROUNDING * scale, f"{quant} {name}: not quantized?"
            checked += 1
    lm_head = loaded_weight(model.model.lm_head, written["lm_head.weight"].shape[1])
    assert (lm_head - written["lm_head.weight"]).abs().max() <= BF16_ROUNDING * written["lm_head.weight"].abs().max()
    assert checked == 4 * len(model.model.model.layers)


@pytest.mark.bench  # lm-eval's imports, two qrt servers, three transformers runs: about two minutes
@pytest.mark.runs_first
def test_the_bench_scores_the_tiny_chat_model_against_its_float32_model(chat_llama_dir, capsys):
    assert lm_eval_quant.main(["--model", str(chat_llama_dir), "--quant", "none,int4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| none |", "| int4 |"))]
    assert len(rows) == 2, rows
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        runtime_mean, quant_mean = float(cells[1]), float(cells[4])
        # The tiny model is float32: served as stored it is its float32 model, summation order aside.
        if cells[0] == "none":
            assert runtime_mean < 1e-3 and quant_mean == 0.0, row
        else:
            assert 0 < quant_mean and runtime_mean < quant_mean, row
