"""compressed-tensors mxfp4-pack-quantized (llm-compressor's MXFP4A16): the weights qrt describes
equal compressed-tensors' own dequantization bit for bit on the producer kit's checkpoint; a tiny
checkpoint written from the format's definition computes, in float32, what transformers computes
with its dequantized weights, and in bf16 on qrt's CPU kernel within bf16's roundings; quantized
activations (the MXFP4 scheme) are refused by name."""

import json

import pytest
import torch
from helpers.checkpoints.format_cases.ct_mxfp4 import write_ct_mxfp4
from helpers.checkpoints.tiny import random_ids
from helpers.compare import relative_l2
from producers.base_models import load_tensors
from test_nvfp4 import producer_variant

from qrt import runtime
from qrt.errors import UnsupportedError
from qrt.formats import mxfp4 as mxfp4_format
from qrt.kernels import native_cpu

SUMMATION_ORDER = 1e-5  # fp32 sums of a few hundred products in another order


@pytest.fixture
def described(monkeypatch):
    """While a model loads, the dequantized weight each layer's loader pass describes, in order."""
    seen = []
    original = mxfp4_format.mxfp4_weights

    def record(blocks, scales):
        weights = original(blocks, scales)
        seen.append(weights.dequantize())
        return weights

    monkeypatch.setattr(mxfp4_format, "mxfp4_weights", record)
    return seen


def load(folder, dtype=torch.float32, compile=False):
    return runtime.compile_model(folder, dtype=dtype, compile=compile, cache=False, progress=False, max_seq_len=64)


def test_weights_equal_compressed_tensors_dequantizer_bit_for_bit(described):
    """The kit's reference holds compressed-tensors' own decompression (E2M1 x 2^(e-127), exact in
    bfloat16 and float32 alike) of the file llm-compressor saved."""
    folder = producer_variant("llmc-mxfp4a16")
    model = load(folder)
    reference = load_tensors(folder / "reference")
    quantized = json.loads((folder / "kit.json").read_text())["quantized_modules"]
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    expected = []
    for name, _ in model.model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        parts = fused.get(leaf, (leaf,))
        if f"{prefix}.{parts[0]}" in quantized:
            expected.append(torch.cat([reference[f"{prefix}.{part}.weight"].float() for part in parts]))
    assert len(described) == len(expected) > 0
    for got, want in zip(described, expected, strict=True):
        both_zero = (got == 0) & (want == 0)  # E2M1's code 8 is -0
        assert int(((got.view(torch.int32) != want.view(torch.int32)) & ~both_zero).sum()) == 0


def test_written_checkpoint_computes_its_dequantized_weights(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    dequantized = write_ct_mxfp4(tmp_path / "ct")
    # transformers' own model with the dequantized weights in place of the codes
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "ct"), dtype=torch.float32)
    state = {**load_tensors(tmp_path / "ct"), **dequantized}
    reference.load_state_dict({k: v for k, v in state.items() if k in reference.state_dict()}, strict=True)
    ids = random_ids(shape=(1, 20))
    with torch.no_grad():
        expected = reference(ids).logits
        got = load(tmp_path / "ct")(ids)
        assert relative_l2(got, expected) < SUMMATION_ORDER
        on_cpu_kernel = load(tmp_path / "ct", dtype=torch.bfloat16)
        # qrt's kernel on the codes where its library is built; the reference op (the codes dequantized
        # on each call) on a CPU without AVX-512
        kernel = "qrt.lut4_pairs_linear" if native_cpu.available() else "qrt.lut4_linear"
        assert on_cpu_kernel.model.model.layers[0].mlp.down_proj.weight.kernel == kernel
        assert relative_l2(on_cpu_kernel(ids), expected) < 2e-2  # bf16 activations and roundings throughout


def test_quantized_activations_are_refused_by_name(tmp_path):
    write_ct_mxfp4(tmp_path / "ct")
    config_path = tmp_path / "ct" / "config.json"
    config = json.loads(config_path.read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {**group["weights"], "dynamic": True}
    config_path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="mxfp4-pack-quantized.*input activations"):
        load(tmp_path / "ct")
