"""Checkpoints made by the real producers, not by qrt's own test writers: GPTQModel, AutoAWQ,
llm-compressor and NVIDIA ModelOpt quantized the same random bases (tests/producers), and each
variant carries a dense float32 reference of the producer's own dequantized weights.

qrt runs each variant the way a user's generation does (a prompt chunk into the KV cache, then one
decode step per token, fed the same tokens), and its logits at every position are compared with
transformers running the reference, which rounds each quantized linear's input (and the FP8 KV
cache) as the format defines, in plain torch. Three runs per variant:

- eager in float32 at tp=1: the loader's reading of the producer's files, to summation order;
- compiled in the checkpoint's own dtype (float16, bfloat16) at tp=1: what a user runs, within
  that dtype's rounding;
- compiled in float32 at tp=2 over two gloo ranks, in one torchrun for every variant one after
  another: row-parallel ranks quantize their part of each activation row with its own range, which
  the reference does too; every rank's logits are equal bit for bit.

Run with `make test-producers`, which builds the kit first (its path: build.py's default, or
$QRT_PRODUCER_KIT)."""

import json
import os
from functools import cache
from pathlib import Path

import pytest
import torch
from activation_quant import (
    UNQUANTIZED, fp8_kv_cache, fp8_per_group, fp8_per_token, fp8_static, int8_per_group, int8_per_token, rounded_inputs)
from bench.tp import torchrun_localhost
from producers import autoawq_variants, gptqmodel_variants, llmcompressor_variants, modelopt_variants
from producers import build as kit_build
from producers.base_models import load_tensors
from tiny_checkpoints import relative_l2
from tp_worker import teacher_forced_logits

from qrt import runtime

pytestmark = pytest.mark.producers

VARIANTS = [*gptqmodel_variants.VARIANTS, *autoawq_variants.VARIANTS, *llmcompressor_variants.VARIANTS,
            *modelopt_variants.VARIANTS]
# 40 byte tokens: 16 as the prompt chunk, then 24 decode steps, so that the compared logits come
# from both graphs and from attention over a KV cache that grows to the whole sequence.
IDS = list(b"Quantized checkpoints from real producers.")[:40]
PREFILL = 16
WORKER = Path(__file__).with_name("tp_worker.py")
TP2_TIMEOUT_S = 2400  # every variant compiled on two ranks, one after another

# Bounds on the relative L2 error of the logits (all positions at once):
# - Weight-only formats in float32: both sides dequantize exactly (small integers times a
#   float16/bfloat16 scale are exact in float32), so only the order of the float32 sums differs,
#   about 1e-7 per layer on these sums of a few hundred terms.
SUMMATION_ORDER = 1e-5
# - With rounded activations, an input lying within that summation noise of a rounding edge
#   rounds one way in qrt and the other in the reference: one e4m3 step (2**-3 of the value) or one
#   int8 step in one element of one row. A few such edges over the 24 rows cost ~1e-4 of the
#   logits; a misplaced or missing scale costs 10% or more.
ONE_EDGE = 2e-3
# - In the checkpoint's dtype qrt rounds every activation and sum to it: unit roundoff u = 2**-11
#   for float16, 2**-8 for bfloat16. Over 4 layers the logits drift by a few u (seen: about 2u);
#   the bound is 8u. Activation-quantized variants also flip the rounding edges that float16
#   inputs move across, one e4m3 step each, hence 16u there.
DTYPE_UNITS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def kit_folder() -> Path:
    return Path(os.environ.get("QRT_PRODUCER_KIT") or kit_build.default_kit_folder())


@cache
def kit() -> dict:
    """The kit's kit.json; fails (does not skip) where the kit was not built."""
    summary = kit_folder() / "kit.json"
    if not summary.exists():
        pytest.fail(f"no producer kit at {kit_folder()}: build it with `make producer-kit` "
                    f"(python tests/producers/build.py)", pytrace=False)
    return json.loads(summary.read_text())


def variant(name: str) -> tuple[Path, dict]:
    """The variant's folder and its kit.json; a variant the kit failed to build fails its tests."""
    summary = kit()
    if name in summary["failed"]:
        pytest.fail(f"{name} was not built: {summary['failed'][name]}", pytrace=False)
    assert name in summary["built"], f"{name} is not in the kit at {kit_folder()}: rebuild it"
    folder = kit_folder() / name
    return folder, json.loads((folder / "kit.json").read_text())


def activation_rounding(folder: Path, info: dict, reference: torch.nn.Module, tp: int):
    """What rounded_inputs needs to round the reference's linear inputs as `info`'s format does at
    `tp` ranks: a row-parallel rank (o_proj, down_proj) quantizes its 1/tp of each input row with
    that part's own range, so a per-token format becomes per-group of K / tp there."""
    kind = info["activation_quant"]
    if kind is None:
        return None
    if kind == "fp8 per-tensor static":
        saved = load_tensors(folder)
        return {module + ".weight": fp8_static(saved[module + ".input_scale"].item())
                for module in info["quantized_modules"]}
    if kind == "fp8 per-group-128 dynamic":
        return fp8_per_group(128)  # a rank's part of a row is whole groups of 128
    per_token, per_group = {"fp8 per-token dynamic": (fp8_per_token, fp8_per_group),
                            "int8 per-token dynamic": (int8_per_token, int8_per_group)}[kind]
    if tp == 1:
        return per_token
    rounding = {}
    for name, param in reference.named_parameters():
        if name.startswith("model.layers.") and param.dim() >= 2 and not name.removesuffix(".weight").endswith(UNQUANTIZED):
            row_parallel = "o_proj" in name or "down_proj" in name
            rounding[name] = per_group(param.shape[-1] // tp) if row_parallel else per_token
    return rounding


def kv_cache_scales(folder: Path, info: dict, layers: int) -> dict | None:
    """{layer: (k_scale, v_scale)} of an FP8 KV cache, as ModelOpt exports them; None without one."""
    if info["kv_cache"] is None:
        return None
    assert info["kv_cache"] == "fp8", info["kv_cache"]
    saved = load_tensors(folder)
    return {i: (saved[f"model.layers.{i}.self_attn.k_proj.k_scale"].item(),
                saved[f"model.layers.{i}.self_attn.v_proj.v_scale"].item()) for i in range(layers)}


@cache
def reference_logits(name: str, tp: int) -> torch.Tensor:
    """transformers on the variant's float32 reference, its activations (and KV cache) rounded as
    the format does at `tp` ranks: float32 logits [len(IDS) - PREFILL + 1, V] at the positions
    teacher_forced_logits gives."""
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    folder, info = variant(name)
    model = AutoModelForCausalLM.from_pretrained(str(folder / "reference"), dtype=torch.float32).eval()
    scales = kv_cache_scales(folder, info, model.config.num_hidden_layers)
    kv = fp8_kv_cache(model, scales) if scales else nullcontext()
    with torch.no_grad(), kv, rounded_inputs(model, activation_rounding(folder, info, model, tp)):
        logits = model(torch.tensor([IDS])).logits[0].float()
    return logits[PREFILL - 1:]


def float32_bound(info: dict) -> float:
    return SUMMATION_ORDER if info["activation_quant"] is None and info["kv_cache"] is None else ONE_EDGE


def checkpoint_dtype(folder: Path) -> torch.dtype:
    return getattr(torch, json.loads((folder / "config.json").read_text())["dtype"])


@pytest.mark.parametrize("name", VARIANTS)
def test_eager_float32_matches_the_producers_reference(name):
    folder, info = variant(name)
    model = runtime.compile_model(folder, dtype=torch.float32, compile=False, cache=False, progress=False,
                                  max_seq_len=64)
    error = relative_l2(teacher_forced_logits(model, IDS, PREFILL), reference_logits(name, 1))
    assert error < float32_bound(info), f"{name} ({info['scheme']}): logits off by {error:.2e}"


@pytest.mark.parametrize("name", VARIANTS)
def test_compiled_in_the_checkpoint_dtype_matches_the_producers_reference(name):
    folder, info = variant(name)
    dtype = checkpoint_dtype(folder)
    model = runtime.compile_model(folder, progress=False, warmup=False, max_seq_len=64)
    units = 8 if info["activation_quant"] is None else 16
    error = relative_l2(teacher_forced_logits(model, IDS, PREFILL), reference_logits(name, 1))
    assert error < units * DTYPE_UNITS[dtype], f"{name} ({dtype}): logits off by {error:.2e}"
    # One graph each for the prompt chunk and the decode steps: no graph break, no recompile.
    assert model.compile_report() == {"prefill": 1, "decode": 1, "forward": 0}, model.compile_report()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Every built variant compiled in float32 at tp=2, one after another in one torchrun."""
    names = [name for name in VARIANTS if name in kit()["built"]]
    jobs = [dict(name=name, path=str(kit_folder() / name), compile=True, dtype="float32", forward=False,
                 ids=[IDS], prompt=IDS[:PREFILL], steps=4, max_seq_len=64,
                 teacher_forced=dict(ids=IDS, prefill=PREFILL)) for name in names]
    folder = tmp_path_factory.mktemp("producers-tp2")
    (folder / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = torchrun_localhost(2, [str(WORKER), str(folder / "jobs.json"), str(folder / "results.pt")], env,
                              TP2_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(folder / "results.pt")


@pytest.mark.parametrize("name", VARIANTS)
def test_compiled_float32_at_tp2_matches_the_producers_reference(name, sharded):
    _, info = variant(name)
    got = sharded[name]
    error = relative_l2(got["teacher_forced"], reference_logits(name, 2))
    assert error < float32_bound(info), f"{name} at tp=2: logits off by {error:.2e}"
    first, second = (rank["teacher_forced"] for rank in got["ranks"])
    assert torch.equal(first, second), f"{name}: the ranks' logits differ"
    for rank in got["ranks"]:
        assert rank["report"] == {"prefill": 1, "decode": 1, "forward": 0}, rank["report"]
