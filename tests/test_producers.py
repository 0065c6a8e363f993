"""Checkpoints made by the real producers, not by qrt's own test writers: GPTQModel, AutoAWQ,
llm-compressor and NVIDIA ModelOpt quantized the same random bases (tests/producers), and each
variant carries a dense float32 reference of the producer's own dequantized weights.

qrt runs each variant the way a user's generation does (a prompt chunk into the KV cache, then one
decode step per token, fed the same tokens), and its logits at every position are compared with
transformers running the reference, which rounds each quantized linear's input (and the FP8 KV
cache) as the format defines, in plain torch. The runs of each variant:

- eager in float32 at tp=1: the loader's reading of the producer's files, to summation order;
- compiled in the checkpoint's own dtype (float16, bfloat16) at tp=1: what a user runs, within
  that dtype's rounding; the 4-bit variants saved in float16 also in bfloat16, where qrt's own
  int4 CPU kernel runs them;
- in float32 at tp=2 over two gloo ranks, eager for every variant and compiled for one variant of
  each kernel and architecture (TP2_COMPILED), in one torchrun one after another: row-parallel
  ranks quantize their part of each activation row with its own range, which the reference does
  too; every rank's logits are equal bit for bit;
- in float32 at tp=4, eager for every variant and compiled for three (TP4_COMPILED), where the
  variants whose groups of 128 a rank's part would cut are refused with the reason.

Every rank of a compiled run traces the same graphs, so a torchrun's compiles cost the ranks
times one process's on a machine with fewer cores than ranks (CI's two): compiling each variant
at tp=2 and tp=4 took 19 minutes there. A variant's producer layout is read by the loader, which
the eager runs check at both sizes; what compiling a sharded model adds (the swap pass over
sharded weights, collectives in the graphs) depends on the kernel and the architecture, which
the compiled selections cover.

Run with `make test-producers`, which builds the kit first (its path: build.py's default, or
$QRT_PRODUCER_KIT)."""

import json
import os
import re
from functools import cache
from pathlib import Path

import pytest
import torch
from bench.tp import torchrun_localhost
from helpers.activation_rounding import (
    DRIFT_FACTOR, NUDGES, UNQUANTIZED, fp8_kv_cache, fp8_per_group, fp8_per_token, fp8_static, int8_per_group,
    int8_per_token, nudged, nvfp4_static_global, reference_drift, rounded_inputs)
from helpers.compare import relative_l2
from helpers.tp_worker import teacher_forced_logits
from producers import autoawq_variants, gptqmodel_variants, llmcompressor_variants, modelopt_variants
from producers import bitsandbytes_variants
from producers import build as kit_build
from producers.base_models import load_tensors

from qrt import runtime
from qrt.kernels import int4_pairs_cpu, native_cpu
from qrt.layers.experts import FusedExperts

pytestmark = pytest.mark.producers

VARIANTS = [*gptqmodel_variants.VARIANTS, *autoawq_variants.VARIANTS, *llmcompressor_variants.VARIANTS,
            *modelopt_variants.VARIANTS, *bitsandbytes_variants.VARIANTS]
# 40 byte tokens: 16 as the prompt chunk, then 24 decode steps, so that the compared logits come
# from both graphs and from attention over a KV cache that grows to the whole sequence.
IDS = list(b"Quantized checkpoints from real producers.")[:40]
PREFILL = 16
WORKER = Path(__file__).parent / "helpers" / "tp_worker.py"
TORCHRUN_TIMEOUT_S = 2400  # every variant on two or four ranks, one after another

# Bounds on the relative L2 error of the logits (all positions at once), or of one linear's output:
# - Both sides dequantize exactly in float32 (small integers times a float16/bfloat16 scale, or an
#   e4m3 code times a scale, are exact there), so in float32 only the order of the sums differs:
#   about 1e-7 per layer on these sums of a few hundred terms.
SUMMATION_ORDER = 1e-5
# - Where activations are rounded to e4m3 (3 significant bits) or int8, the whole-model logits are
#   chaotic on these deliberately sharp bases: an input within summation noise of a rounding edge
#   goes one way in one run and the other in the next, a whole step, and the difference grows
#   through the layers. The reference shows how far: run in float64 instead of float32, or with
#   its embeddings nudged by one ulp (the same model and roundings, only the arithmetic changed),
#   its logits move by up to 2e-2 on the fp8 variants, as far as qrt's are from it. Likewise in
#   the checkpoint's dtype: transformers in float16 moves by about 1e-3 (2u, u = 2**-11) without
#   rounded activations, 5e-2 with them. A compiled kernel that rounds its sums beyond the format
#   (KERNEL_ROUNDING) is measured by the reference's move under that rounding too. So each
#   whole-model bound is DRIFT_FACTOR times the reference's largest such move (never below
#   SUMMATION_ORDER), and the layer-by-layer test below, which feeds both sides the same inputs
#   and has no drift, holds every quantized linear and every MoE block's routed experts to
#   SUMMATION_ORDER. A misplaced or missing scale costs 10% or more of a layer's output, and an
#   expert's 5% one 5e-2 of its block's. On the FP8 MoE variant the reference itself moves by
#   4.6e-2 (float64 or nudged), so its whole-model bound is 0.18, while qrt lands within 1e-6 of
#   the reference: the layer-by-layer test is the one that holds it tight.


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


@cache
def saved_tensors(name: str) -> dict[str, torch.Tensor]:
    """The variant's checkpoint tensors, as the producer saved them (read once)."""
    return load_tensors(kit_folder() / name)


@cache
def reference_model(name: str, dtype: str) -> torch.nn.Module:
    """transformers on the variant's float32 reference, in `dtype` (loaded once per dtype)."""
    from transformers import AutoModelForCausalLM

    folder, _ = variant(name)
    model = AutoModelForCausalLM.from_pretrained(str(folder / "reference"), dtype=getattr(torch, dtype)).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # its grouped matmul takes no float64
    return model


def activation_rounding(name: str, info: dict, reference: torch.nn.Module, tp: int):
    """What rounded_inputs needs to round the reference's linear inputs as `info`'s format does at
    `tp` ranks: a row-parallel rank (o_proj, down_proj) quantizes its 1/tp of each input row with
    that part's own range, so a per-token format becomes per-group of K / tp there."""
    kind = info["activation_quant"]
    if kind is None:
        return None
    if kind == "fp8 per-tensor static":
        saved = saved_tensors(name)
        return {module + ".weight": fp8_static(saved[module + ".input_scale"].item())
                for module in info["quantized_modules"]}
    if kind == "fp8 per-group-128 dynamic":
        return fp8_per_group(128)  # a rank's part of a row is whole groups of 128
    if kind == llmcompressor_variants.NVFP4_ACTIVATIONS:  # groups of 16, whole in a rank's part too
        saved = saved_tensors(name)
        return {module + ".weight": nvfp4_static_global(saved[module + ".input_global_scale"].item())
                for module in info["quantized_modules"]}
    if kind == modelopt_variants.NVFP4_ACTIVATIONS:  # ModelOpt's input_scale is 1 / the global scale
        saved = saved_tensors(name)
        return {module + ".weight": nvfp4_static_global(1 / saved[module + ".input_scale"].item())
                for module in info["quantized_modules"]}
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


def kv_cache_scales(name: str, info: dict, layers: int) -> dict | None:
    """{layer: (k_scale, v_scale)} of an FP8 KV cache, as ModelOpt exports them; None without one."""
    if info["kv_cache"] is None:
        return None
    assert info["kv_cache"] == "fp8", info["kv_cache"]
    saved = saved_tensors(name)
    return {i: (saved[f"model.layers.{i}.self_attn.k_proj.k_scale"].item(),
                saved[f"model.layers.{i}.self_attn.v_proj.v_scale"].item()) for i in range(layers)}


def bf16_sums(y: torch.Tensor) -> torch.Tensor:
    return y.to(torch.bfloat16)


# What a compiled kernel rounds beyond the format's definition, by activation format: qrt's CPU
# W8A8 kernel (qrt/kernels/int8_cpu.py) gets its integer sums back from ATen's int8 GEMM in bf16.
KERNEL_ROUNDING = {"int8 per-token dynamic": bf16_sums}


@cache
def reference_logits(name: str, tp: int, dtype: str = "float32", nudge: int = 0, kernel_rounding: bool = False) -> torch.Tensor:
    """transformers on the variant's float32 reference, run in `dtype`, its activations (and KV
    cache) rounded as the format does at `tp` ranks, its embeddings nudged by activation_rounding's
    `nudged(..., nudge)` (0: not), its quantized linears' outputs rounded as KERNEL_ROUNDING says
    when `kernel_rounding`: float32 logits [len(IDS) - PREFILL + 1, V] at the positions
    teacher_forced_logits gives."""
    from contextlib import nullcontext

    _, info = variant(name)
    model = reference_model(name, dtype)
    scales = kv_cache_scales(name, info, model.config.num_hidden_layers)
    kv = fp8_kv_cache(model, scales) if scales else nullcontext()
    outputs = KERNEL_ROUNDING.get(info["activation_quant"]) if kernel_rounding else None
    with torch.no_grad(), kv, rounded_inputs(model, activation_rounding(name, info, model, tp), outputs):
        embeddings = model.get_input_embeddings()(torch.tensor([IDS]))
        if nudge:
            embeddings = nudged(embeddings, nudge)
        logits = model(inputs_embeds=embeddings).logits[0].float()
    return logits[PREFILL - 1:]


def drift_bound(name: str, tp: int, dtype: str, compiled: bool = False) -> float:
    """DRIFT_FACTOR times how far the float32 reference moves under changes of arithmetic alone:
    for float32 runs, in float64 or with nudged embeddings (activation_rounding.reference_drift), and
    for a compiled run with a kernel that rounds its sums, with those sums rounded likewise; for
    the checkpoint's dtype, run in it (nudged or not). Never below SUMMATION_ORDER."""
    base = reference_logits(name, tp)
    if dtype == "float32":
        move = reference_drift(lambda wide, nudge: reference_logits(name, tp, str(wide).removeprefix("torch."), nudge))
    else:
        move = max(relative_l2(reference_logits(name, tp, dtype, nudge), base) for nudge in range(NUDGES + 1))
    if compiled and KERNEL_ROUNDING.get(variant(name)[1]["activation_quant"]):
        move = max(move, relative_l2(reference_logits(name, tp, kernel_rounding=True), base))
    return max(SUMMATION_ORDER, DRIFT_FACTOR * move)


def checkpoint_dtype(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["dtype"]


@pytest.mark.parametrize("name", VARIANTS)
def test_eager_float32_matches_the_producers_reference(name):
    folder, info = variant(name)
    model = runtime.compile_model(folder, dtype=torch.float32, compile=False, cache=False, progress=False,
                                  max_seq_len=64)
    error = relative_l2(teacher_forced_logits(model, IDS, PREFILL), reference_logits(name, 1))
    assert error < drift_bound(name, 1, "float32"), f"{name} ({info['scheme']}): logits off by {error:.2e}"


# qrt's fused linears and the reference's modules they hold, in their order along the output.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
DENSE_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.mark.parametrize("name", VARIANTS)
def test_each_quantized_linear_matches_the_reference_on_qrts_own_inputs(name):
    """Layer by layer, without the whole model's drift: each of qrt's attention and dense MLP
    linears, and each MoE block's routed experts with the routing qrt chose (eager, float32), is
    given its input, and the reference computes the output from that same input, rounded as the
    format does, with the producer's dequantized weights."""
    folder, info = variant(name)
    model = runtime.compile_model(folder, dtype=torch.float32, compile=False, cache=False, progress=False,
                                  max_seq_len=64)
    seen = {}

    def keep(key):
        def hook(_module, args, out) -> None:  # returns None: the output stays as it is
            seen[key] = (args[0], out)
        return hook

    experts_seen = {}
    for module_name, module in model.model.named_modules():
        if module_name.rpartition(".")[2] in DENSE_LINEARS:
            module.register_forward_hook(keep(module_name))
        if isinstance(module, FusedExperts):
            module.register_forward_hook(lambda mod, args, out, key=module_name: experts_seen.__setitem__(key, (*args, out)))
    with torch.no_grad():
        model(torch.tensor([IDS]))
    reference = reference_model(name, "float32")
    parameters = dict(reference.named_parameters())
    rounding = activation_rounding(name, info, reference, 1)
    assert len(seen) >= 2 * reference.config.num_hidden_layers, sorted(seen)  # attention at least
    failures = []
    for module_name, (x, topk_ids, topk_weights, y) in experts_seen.items():
        expected = routed_experts_reference(reference, parameters, module_name, x, topk_ids, topk_weights, rounding)
        if (error := relative_l2(y, expected)) > SUMMATION_ORDER:
            failures.append(f"{module_name}: off by {error:.2e}")
    assert ("moe" in name) == bool(experts_seen), sorted(experts_seen)
    for module_name, (x, y) in seen.items():
        parent, _, leaf = module_name.rpartition(".")
        expected = []
        for part in FUSED.get(leaf, (leaf,)):
            weight = f"{parent}.{part}.weight"
            round_input = rounding if callable(rounding) else (rounding or {}).get(weight)
            x_in = round_input(x).to(x.dtype) if round_input else x
            expected.append(torch.nn.functional.linear(x_in, parameters[weight], parameters.get(f"{parent}.{part}.bias")))
        error = relative_l2(y, torch.cat(expected, dim=-1))
        if error > SUMMATION_ORDER:
            failures.append(f"{module_name}: off by {error:.2e}")
    assert not failures, f"{name}:\n" + "\n".join(failures)


def routed_experts_reference(reference, parameters: dict, module_name: str, x, topk_ids, topk_weights, rounding):
    """What qrt's experts module `module_name` should return for its inputs x [T, D] and the
    routing it was given (topk_ids, topk_weights [T, k]), from the reference's stacked experts
    (transformers: gate_up_proj [E, 2I, D] with gate first, down_proj [E, D, I]), each
    projection's input rounded as the format does; a plain loop over tokens and their experts."""
    from transformers.activations import ACT2FN

    act = ACT2FN[reference.config.hidden_act]
    gate_up, down = (f"{module_name}.{leaf}" for leaf in ("gate_up_proj", "down_proj"))
    rounders = [rounding if callable(rounding) else (rounding or {}).get(p) for p in (gate_up, down)]

    def rounded(which: int, v):
        return rounders[which](v).to(v.dtype) if rounders[which] else v

    out = torch.zeros_like(x)  # [T, D]
    with torch.no_grad():
        for t in range(x.shape[0]):
            for e, w in zip(topk_ids[t].tolist(), topk_weights[t]):
                gate, up = torch.nn.functional.linear(rounded(0, x[t:t + 1]), parameters[gate_up][e]).chunk(2, dim=-1)
                out[t] += w * torch.nn.functional.linear(rounded(1, act(gate) * up), parameters[down][e])[0]
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_compiled_in_the_checkpoint_dtype_matches_the_producers_reference(name):
    folder, info = variant(name)
    dtype = checkpoint_dtype(folder)
    model = runtime.compile_model(folder, progress=False, warmup=False, max_seq_len=64)
    error = relative_l2(teacher_forced_logits(model, IDS, PREFILL), reference_logits(name, 1))
    assert error < drift_bound(name, 1, dtype, compiled=True), f"{name} ({dtype}): logits off by {error:.2e}"
    # One graph each for the prompt chunk and the decode steps: no graph break, no recompile.
    assert model.compile_report() == {"prefill": 1, "decode": 1, "forward": 0}, model.compile_report()


# The 4-bit weight-only variants saved in float16. A user may run them in bfloat16, where the CPU
# runs qrt's own int4 kernel and pack (qrt/kernels/int4_pairs_cpu.py) rather than ATen's, where
# qrt's library is built (not on a CPU without AVX-512: there ATen's pack runs them, and none is
# on qrt's).
INT4_IN_FLOAT16 = [name for name in VARIANTS if "w4" in name and not name.endswith("-moe")]


@pytest.mark.parametrize("name", INT4_IN_FLOAT16)
def test_compiled_in_bfloat16_on_qrts_int4_kernel_matches_the_producers_reference(name):
    folder, info = variant(name)
    model = runtime.compile_model(folder, dtype=torch.bfloat16, progress=False, warmup=False, max_seq_len=64)
    packed = [module for module in model.model.modules()
              if isinstance(getattr(module, "weight", None), torch.Tensor) and int4_pairs_cpu.is_packed(module.weight)]
    layers = reference_model(name, "float32").config.num_hidden_layers
    if native_cpu.available():
        assert len(packed) >= 2 * layers, f"{name}: {len(packed)} linears on qrt's int4 pack"
    else:
        assert not packed, f"{name}: {len(packed)} linears on qrt's int4 pack, whose library is not built"
    error = relative_l2(teacher_forced_logits(model, IDS, PREFILL), reference_logits(name, 1))
    assert error < drift_bound(name, 1, "bfloat16", compiled=True), f"{name} (bfloat16): logits off by {error:.2e}"
    assert model.compile_report() == {"prefill": 1, "decode": 1, "forward": 0}, model.compile_report()


# The variants compiled at tp=2: one of each kernel, and the architectures (Qwen2's biases, the
# MoE experts). The others share a kernel with one of these once loaded: AutoAWQ's and
# llm-compressor's int4 GPTQModel's, ModelOpt's FP8 llm-compressor's, the weight-only NVFP4s and
# bitsandbytes' other 4-bit types the 16-entry table's.
TP2_COMPILED = {"gptqmodel-w4g128-asym", "gptqmodel-w4g128-actorder", "gptqmodel-w4g128-sym-qwen2",
                "gptqmodel-w4g128-sym-moe", "gptqmodel-w8g128-sym", "llmc-2of4-w4a16", "llmc-fp8-static",
                "llmc-fp8-block", "llmc-w8a8-int8", "llmc-fp8-dynamic-moe", "llmc-nvfp4", "llmc-mxfp4a16",
                "modelopt-fp8-kv", "bnb-nf4-moe", "bnb-int8"}
# At tp=4 a rank's parts are a quarter: act-order's regrouped int4, activations quantized per
# token, and an MoE's experts, compiled on them.
TP4_COMPILED = {"gptqmodel-w4g128-actorder", "llmc-nvfp4", "llmc-fp8-dynamic-moe"}


def sharded_runs(compiled: set[str]) -> list[tuple[str, str]]:
    """(variant, mode) of a sharded run: every variant eagerly, those in `compiled` compiled too."""
    return [(name, mode) for name in VARIANTS for mode in ("compiled", "eager") if mode == "eager" or name in compiled]


def run_sharded(tmp_path_factory, tp: int, compiled: set[str]) -> dict:
    """Every built variant in float32 at `tp` ranks, eagerly, and those in `compiled` compiled too,
    one after another in one torchrun: results by "NAME MODE" (MODE "eager" or "compiled"). A
    variant whose layers do not split into `tp` parts is recorded as refused, with qrt's reason."""
    runs = [(name, mode) for name, mode in sharded_runs(compiled) if name in kit()["built"]]
    jobs = [dict(name=f"{name} {mode}", path=str(kit_folder() / name), compile=mode == "compiled", dtype="float32",
                 forward=False, ids=[IDS], prompt=IDS[:PREFILL], steps=4, max_seq_len=64, may_refuse=True,
                 teacher_forced=dict(ids=IDS, prefill=PREFILL)) for name, mode in runs]
    folder = tmp_path_factory.mktemp(f"producers-tp{tp}")
    (folder / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = torchrun_localhost(tp, [str(WORKER), str(folder / "jobs.json"), str(folder / "results.pt")], env,
                              TORCHRUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(folder / "results.pt")


@pytest.fixture(scope="module")
def sharded_in_two(tmp_path_factory):
    return run_sharded(tmp_path_factory, 2, TP2_COMPILED)


@pytest.fixture(scope="module")
def sharded_in_four(tmp_path_factory):
    return run_sharded(tmp_path_factory, 4, TP4_COMPILED)


def check_sharded(name: str, tp: int, got: dict, compiled: bool) -> None:
    """`got` (a run_sharded result) within the drift bound of the producer's reference at `tp`,
    every rank's logits equal bit for bit, one graph per role on every rank when compiled."""
    assert got["refused"] is None, got["refused"]
    error = relative_l2(got["teacher_forced"], reference_logits(name, tp))
    assert error < drift_bound(name, tp, "float32", compiled), f"{name} at tp={tp}: logits off by {error:.2e}"
    first, *others = (rank["teacher_forced"] for rank in got["ranks"])
    assert all(torch.equal(first, other) for other in others), f"{name}: the ranks' logits differ"
    expected_report = {"prefill": 1, "decode": 1, "forward": 0} if compiled else {"prefill": 0, "decode": 0, "forward": 0}
    for rank in got["ranks"]:
        assert rank["report"] == expected_report, rank["report"]


# One torchrun serves every variant at a world size (the module fixtures above): under pytest-xdist
# its tests stay in one worker (`make test-producers` deals out groups), and start first.
@pytest.mark.xdist_group("tp2")
@pytest.mark.runs_first
@pytest.mark.parametrize("name,mode", sharded_runs(TP2_COMPILED))
def test_float32_at_tp2_matches_the_producers_reference(name, mode, sharded_in_two):
    check_sharded(name, 2, sharded_in_two[f"{name} {mode}"], compiled=mode == "compiled")


def test_the_compiled_selections_name_variants():
    assert TP2_COMPILED <= set(VARIANTS) and TP4_COMPILED <= SPLIT_IN_FOUR, (TP2_COMPILED - set(VARIANTS),
                                                                            TP4_COMPILED - SPLIT_IN_FOUR)


# At tp=4 each rank holds 2 of the bases' 8 heads and 1 of their 4 KV heads, but o_proj's 64 and
# the dense down_proj's 192 input features per rank (the MoE experts': 64) are not whole groups of
# 128: the grouped variants are refused, naming the tensor and the largest tp that works. The
# rest run: per-channel and per-tensor scales split anywhere, and act-order keeps its group
# scales whole on every rank.
SPLIT_IN_FOUR = {"gptqmodel-w4g128-actorder", "llmc-fp8-static", "llmc-fp8-dynamic", "llmc-w8a8-int8",
                 "llmc-fp8-dynamic-moe", "modelopt-fp8", "modelopt-fp8-kv",
                 # NVFP4's groups of 16 and MXFP4's blocks of 32: a rank's 64 or 192 input features are
                 # whole groups.
                 *(name for name in VARIANTS if "nvfp4" in name or "mxfp4" in name),
                 # bitsandbytes' blocks of 64 (and its int8 rows): 64 and 192 features are whole blocks.
                 *(name for name in VARIANTS if name.startswith("bnb-"))}


@pytest.mark.xdist_group("tp4")
@pytest.mark.runs_first
@pytest.mark.parametrize("name,mode", sharded_runs(TP4_COMPILED))
def test_float32_at_tp4_matches_the_producers_reference_or_is_refused(name, mode, sharded_in_four):
    got = sharded_in_four[f"{name} {mode}"]
    if name in SPLIT_IN_FOUR:
        check_sharded(name, 4, got, compiled=mode == "compiled")
    else:
        assert got["refused"] and re.search(r"input (features|channels).*(128 input features per entry|multiple of "
                                            r"group_size=128)", got["refused"]), got["refused"]


# A LoRA adapter beside each producer's weight-only format: against PEFT over the producer's
# reference (its own dequantized weights), at the float32 bound of the base alone.
LORA_BASES = ("gptqmodel-w4g128-sym", "gptqmodel-w4g128-actorder", "autoawq-w4g128-gemm", "llmc-w4a16-asym",
              "bnb-nf4", "llmc-nvfp4a16", "llmc-mxfp4a16")


@pytest.mark.parametrize("name", LORA_BASES)
def test_a_lora_adapter_on_the_producers_weights_matches_peft_over_the_reference(name, tmp_path):
    import copy

    from helpers.lora_adapters import peft_logits, peft_over_model, random_peft_adapter

    folder, info = variant(name)
    model = runtime.compile_model(folder, dtype=torch.float32, compile=False, cache=False, progress=False,
                                  max_seq_len=64, max_loras=1)
    adapter = random_peft_adapter(model.model.config, tmp_path / "adapter", seed=3)
    model.load_lora("a", adapter)
    model.lora.bind(0, model.lora.residents["a"])
    ours = teacher_forced_logits(model, IDS, PREFILL)
    reference = peft_over_model(copy.deepcopy(reference_model(name, "float32")), adapter)
    theirs = peft_logits(reference, torch.tensor([IDS]))[0, PREFILL - 1:]
    base = reference_logits(name, 1)
    assert relative_l2(theirs, base) > 100 * SUMMATION_ORDER  # the adapter moves the logits
    error = relative_l2(ours, theirs)
    assert error < drift_bound(name, 1, "float32"), f"{name} ({info['scheme']}) with LoRA: logits off by {error:.2e}"
