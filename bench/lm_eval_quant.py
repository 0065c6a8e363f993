"""lm-eval scores of qrt's online quantizations against their own float32 models.

    python -m bench.lm_eval_quant                         # none (bf16), int4 and fp8 on the default model
    python -m bench.lm_eval_quant --quant int4 --model PATH

A quantized model's scores differ from the checkpoint's for two reasons: its weights are not the
checkpoint's (quantization itself), and the runtime computes with them in its own way (bf16
activations, fp8 activations rounded per token at run time, its kernels' summation order). This
separates the two. For each --quant, on the multiple-choice task of bench/lm_eval_task.py:
- lm-eval's `local-completions` scores it against `qrt serve PATH --quant Q`;
- lm-eval's `hf` backend (transformers) scores the same task on Q's float32 model: the weights
  qrt's quantizer makes for Q, dequantized exactly and written as a float32 checkpoint;
- and on the checkpoint itself in float32, and in bf16 (transformers' own bf16 arithmetic, the
  yardstick of tests/test_lm_eval_default_model.py).
It reports the mean and worst per-choice difference and the answers flipped: served against Q's
float32 model (the runtime's arithmetic) and Q's float32 model against the checkpoint's (the
quantization's own). "none" runs the checkpoint as stored (bf16 for the default model); its float32
model is the checkpoint's.

Q's float32 model is built from qrt's own quantizers (`quantize_int_rows`, `quantize_rows_fp8`),
applied to the layers the online formats quantize: every decoder linear, and lm_head as int8 per
channel (tests/test_bench_lm_eval_quant.py checks the folder against the quantized model qrt loads).
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.lm_eval_task import (LONG_QUESTIONS, QUESTIONS, chosen, differences, evaluate, served_scores,
                                 write_mc_task)

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTS = ("none", "int4", "fp8")


def checkpoint_dtype(config: dict) -> torch.dtype:
    """The dtype qrt loads the checkpoint in, which the integer formats round their scales to."""
    return getattr(torch, config.get("torch_dtype") or config.get("dtype") or "bfloat16")


def _int_dequantized(weight: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """What quantize_int_rows makes of weight [N, K], dequantized: fp32 [N, K]."""
    from qrt.formats.int_online import quantize_int_rows
    from qrt.kernels.int_reference import IntWeights

    q, scales, zeros = quantize_int_rows(weight, bits, group, scale_dtype)  # [N, K], [N, groups], [N, groups]
    return IntWeights(q.t(), scales.t(), zeros.t(), bits, group).dequantize()


def dequantized_weight(weight: torch.Tensor, quant: str, lm_head: bool, scale_dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] as the online format `quant` stores it in a model of scale_dtype,
    dequantized: fp32 [N, K]."""
    from qrt.formats.int_online import OnlineIntConfig
    from qrt.kernels.fp8_reference import quantize_rows_fp8

    if lm_head:  # int8 per channel for every weight-only and fp8 online format
        return _int_dequantized(weight, 8, weight.shape[1], scale_dtype)
    if quant == "int4":
        group = OnlineIntConfig(4, max_group=32).group_size(weight.shape[1])
        return _int_dequantized(weight, 4, group, scale_dtype)
    if quant == "fp8":
        codes, scales = quantize_rows_fp8(weight)  # [N, K] e4m3, [N, 1] fp32
        return codes.float() * scales
    raise ValueError(f"no float32 model for quant {quant!r}; this bench knows {', '.join(QUANTS)}")


def write_float32_model(checkpoint: Path, quant: str, out: Path) -> Path:
    """A float32 copy of the llama-style checkpoint folder in `out`, with `quant`'s weights
    dequantized ("none": the checkpoint's own weights). lm_head gets a weight of its own, untied.
    Returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy(item, out / item.name)
    tensors = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(shard))
    config = json.loads((checkpoint / "config.json").read_text())
    scale_dtype = checkpoint_dtype(config)
    if "lm_head.weight" not in tensors:  # tied to the embeddings
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    weights = {}
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        quantized = quant != "none" and name.endswith(".weight") and (
            module.endswith(DECODER_LINEARS) or module == "lm_head")
        weights[name] = (dequantized_weight(value, quant, module == "lm_head", scale_dtype) if quantized
                         else value.float()).contiguous()
    save_file(weights, str(out / "model.safetensors"))
    config.update(tie_word_embeddings=False, torch_dtype="float32")
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def hf_scores(folder: Path, dtype: str, work: Path) -> list[list[float]]:
    return evaluate("hf", {"pretrained": str(folder), "dtype": dtype}, work, tasks=["qrt_mc"])["qrt_mc"]


def accuracy(scores: list[list[float]], questions) -> float:
    return sum(chosen(doc) == answer for doc, (_, _, answer) in zip(scores, questions)) / len(questions)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a llama-style bf16 folder (default: the default model)")
    parser.add_argument("--quant", default=",".join(QUANTS), help=f"comma-separated, of {', '.join(QUANTS)}")
    args = parser.parse_args(argv)
    if args.model is None:
        from qrt.runtime.default_model import default_model_path

        args.model = default_model_path()
    quants = args.quant.split(",")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY="lm-eval-key")
    questions = QUESTIONS + LONG_QUESTIONS
    with tempfile.TemporaryDirectory(prefix="qrt-lm-eval-quant-") as tmp:
        work = Path(tmp)
        write_mc_task(work, questions)
        checkpoint32 = hf_scores(args.model, "float32", work)
        checkpoint16 = hf_scores(args.model, "bfloat16", work)
        mean, worst, flips = differences(checkpoint16, checkpoint32)
        print(f"{args.model.name}: {len(questions)} questions; accuracy in float32 {accuracy(checkpoint32, questions):.3f}")
        print(f"yardstick, transformers bf16 against the checkpoint in float32: mean {mean:.4f} worst {worst:.4f} "
              f"flips {flips}\n")
        print("| quant | served vs its float32 model: mean | worst | flips | its float32 model vs the checkpoint's: "
              "mean | worst | flips | accuracy served | accuracy of its float32 model |")
        print("|---|---|---|---|---|---|---|---|---|")
        for quant in quants:
            own32 = checkpoint32 if quant == "none" else hf_scores(
                write_float32_model(args.model, quant, work / f"float32-{quant}"), "float32", work)
            served = served_scores(args.model, work, quant=None if quant == "none" else quant)
            runtime_gap, quant_gap = differences(served, own32), differences(own32, checkpoint32)
            print(f"| {quant} | {runtime_gap[0]:.4f} | {runtime_gap[1]:.4f} | {runtime_gap[2]} | {quant_gap[0]:.4f} | "
                  f"{quant_gap[1]:.4f} | {quant_gap[2]} | {accuracy(served, questions):.3f} | "
                  f"{accuracy(own32, questions):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
