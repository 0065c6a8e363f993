"""Every Triton GEMM of qrt, checked against its plain-torch reference op and timed against torch's
own GEMMs, as fractions of this card's measured ceilings; then decode tokens/s of a ~1B Llama.

    python -m bench.gpu                                    # one H100/H200, under 8 minutes
    python -m bench.gpu --only fp8,int8                    # some sections: fp8, int, int8, decode
    TRITON_INTERPRET=1 python -m bench.gpu --smoke         # CPU: toy sizes, every check, no timing worth reading

Sections (--only); the kernel ones are timed next to bf16 F.linear at M in {1, 16, 256, 4096} on
[N, K] weights of 4096x4096 and 4096x14336 (Llama-3-8B's attention output and MLP down projection):
- fp8: qrt::fp8_linear_triton (per-token activations, per-channel weights), its GEMM alone on
  activations already quantized, torch._scaled_mm on those same operands, and the static-scale
  (fp8_static_triton.py) and block-scaled 128x128 (fp8_block_triton.py) linears;
- int: W4A16 in groups of 128 and W8A16 per channel (qrt::int_linear_triton);
- int8: W8A8 and W4A8 g128 (int8_triton.py, w4a8_triton.py), the fused RMSNorm + int8 quantizer
  followed by the W8A8 GEMM alone, and torch._int_mm with torch ops quantizing and rescaling around
  it (on CUDA it needs M > 16, so it has no rows at M = 1 and 16);
- decode: the random-weight ~1B Llama of bench/tools/random_llama.py through
  `runtime.compile_model(path, quant, device="cuda")` in bf16, fp8 and int4: 128 new tokens after a
  32-token prompt, median of 3 runs [min–max], as a fraction of its roofline (HBM ceiling ÷ weight
  bytes per decode step).

Every Triton kernel is first checked against its reference op at each size ("check ... ok" or
FAILED; any failure makes the exit status 1), then timed. A time is the median of REPS CUDA-event
measurements after WARMUP calls, with a 256 MiB buffer zeroed before each so that the weight comes
from HBM, not L2 (H200's is 50 MiB), as it would between a model's layers. Where the host takes
longer to launch an op's kernels than the GPU takes to run them (small M), that launch time counts:
it is what an eager caller pays. TB/s counts each implementation's inputs and output once, the
least traffic it needs; TFLOP/s counts 2·M·N·K. Both are also printed as fractions of the ceilings
measured first: HBM read bandwidth (a sum over 2 GiB) and dense bf16, fp8 and int8 matmuls at
8192³ (torch.matmul, torch._scaled_mm, torch._int_mm). A kernel's FLOP/s is compared with the
ceiling of the MMA it feeds: W4A16 and W8A16 dequantize into bf16 MMAs.

Time budget of a full run (under 8 minutes on one H200, estimated, cold caches):
- 92 timed configurations (12 rows at each of 4 M x 2 shapes, less torch._int_mm's 4 at M <= 16)
  plus 4 ceilings, each WARMUP + REPS = 60 calls. The slowest call, a 4096x14336 GEMM at M = 4096
  (481 GFLOP), takes at most ~5 ms even at 100 TFLOP/s, plus ~0.1 ms of flush: under 100 x 60 x
  5 ms = 30 s in all, ~5 s in practice;
- Triton's first calls: ~12 kernels, each compiled for up to 4 tile configurations and
  specializations (M = 1, <= 16, <= 256, larger), about 50 compiles of 1–3 s: ~2 min;
- the checks: reference ops in fp32 / fp64 on the GPU, under 0.1 s each: ~10 s;
- decode: writing the 1B checkpoint into the qrt cache once (~30 s), then per format loading
  (~10 s), Inductor's cold compile of prefill and decode (30–60 s) and 8 generate calls (one untimed
  and 3 timed of 1 and of 129 tokens, ~1 s each at >= 150 tok/s): ~75 s x 3, under 4 min.
Together ~6.5 minutes; the first figure to grow past the budget would be Inductor's compile time.
"""

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import qrt.kernels.fp8_block_triton  # noqa: F401  (registers the Triton ops)
import qrt.kernels.fp8_static_triton  # noqa: F401
import qrt.kernels.int8_fused_triton  # noqa: F401
import qrt.kernels.int8_triton  # noqa: F401
import qrt.kernels.int_triton  # noqa: F401
import qrt.kernels.w4a8_triton  # noqa: F401
from bench.measure import TokenClock, check_length, name_list, prompt_ids, speeds, timed_decodes, timed_runs
from bench.tools.random_llama import LLAMA_1B, random_llama_path
from bench.roofline import weight_bytes_per_token
from qrt.kernels.fp8_reference import FP8_DTYPE, FP8_MAX, quantize_rows_fp8
from qrt.kernels.fp8_triton import fp8_gemm_triton, quantize_rows_fp8_triton
from qrt.kernels.activation_reference import rms_norm
from qrt.kernels.int8_reference import quantize_rows_int8
from qrt.kernels.int_reference import pack_rows
from qrt.runtime import compile_model

SECTIONS = ("fp8", "int", "int8", "decode")
ROWS = (1, 16, 256, 4096)
SHAPES = ((4096, 4096), (4096, 14336))  # [N, K]
SMOKE_ROWS = (1, 5)
SMOKE_SHAPES = ((48, 256),)  # [N, K]: K holds two groups of 128, N a partial block of 128
WARMUP, REPS = 10, 50
SMOKE_WARMUP, SMOKE_REPS = 1, 2  # the interpreter is slow; these runs only prove the timing path works
FLUSH_BYTES = 256 * 2**20  # > H200's 50 MiB L2
GROUP = 128  # W4A16 and W4A8 groups, block-fp8 blocks (block_n = block_k)
NORM_EPS = 1e-5
CEILING_SIZE = 8192  # dense matmuls of 8192³: large enough to reach the MMA peak
HBM_CEILING_BYTES = 2 * 2**30
DECODE_QUANTS = {"bf16": None, "fp8": "fp8", "int4": "int4"}  # row name -> compile_model's quant
PROMPT_TOKENS, NEW_TOKENS, DECODE_RUNS = 32, 128, 3

# Worst |error| over the largest |output|, per kernel family:
# - fp8: the kernel and the reference round fp32 sums that differ only in order to bf16, so they
#   may land a step (<= 2**-7) apart; the bound allows two;
# - int weight-only: the kernel dequantizes into bf16 before its MMA, the reference stays in fp32;
# - int8: integer sums are exact on both sides; the output's bf16 rounding differs (the interpreter
#   truncates), and for the fused norm a code on a rounding edge may differ.
FP8_ERR = 2.0**-6
INT_ERR = 2.0**-5
INT8_ERR = 2.0**-6


@dataclass
class Impl:
    """One row of the table: an implementation of x [M, K] @ W [N, K]^T."""

    name: str
    mma: str  # the dense ceiling its FLOP/s is a fraction of: "bf16", "fp8" or "int8"
    run: Callable[[], torch.Tensor]
    reads: int  # bytes of its inputs; with the output's, the least traffic it needs
    reference: Callable[[], torch.Tensor] | None = None  # the plain-torch op it must match; None: torch's own
    max_err: float = 0.0


@dataclass
class Case:
    m: int
    n: int
    k: int
    impls: list[Impl]


def time_us(fn, warmup: int, reps: int, flush: torch.Tensor | None) -> float:
    """Median time of fn() in µs: CUDA events on a GPU, the wall clock otherwise (flush None)."""
    for _ in range(warmup):
        fn()
    if flush is None:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        # Evict the previous run's weight from L2, so it comes from HBM as it would in a model
        # that runs other layers in between.
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bf16_impls(x: torch.Tensor, w_bf16: torch.Tensor) -> list[Impl]:
    return [Impl("bf16 F.linear", "bf16", lambda: F.linear(x, w_bf16), nbytes(x, w_bf16))]


def fp8_impls(x: torch.Tensor, w_bf16: torch.Tensor) -> list[Impl]:
    n, k = w_bf16.shape
    w, w_scale = quantize_rows_fp8(w_bf16)  # [N, K] fp8, [N, 1] fp32
    w_scale = w_scale.view(-1)  # [N]
    xq, x_scale = quantize_rows_fp8_triton(x)  # [M, K] fp8, [M, 1] fp32: exactly the reference's codes
    input_scale = (x.float().abs().amax() / FP8_MAX).reshape(1)  # [1] fp32, as calibration would set it
    # [N / 128, K / 128] fp32: of the order of the per-channel scales of a 0.02-std weight.
    block_scale = torch.rand(-(-n // GROUP), -(-k // GROUP), device=x.device) * 2e-4 + 1e-4

    def per_token():  # the reference op of the per-token linear and of its GEMM alone
        return torch.ops.qrt.fp8_linear(x, w, w_scale, None)

    return [
        Impl("_scaled_mm", "fp8",
             lambda: torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                                      out_dtype=torch.bfloat16),
             nbytes(xq, w, x_scale, w_scale)),
        # The GEMM alone on the reference's codes and scales: the per-token reference is its oracle.
        Impl("fp8 GEMM", "fp8", lambda: fp8_gemm_triton(xq, w, x_scale, w_scale, None, torch.bfloat16),
             nbytes(xq, w, x_scale, w_scale), per_token, FP8_ERR),
        Impl("fp8 per-token linear", "fp8", lambda: torch.ops.qrt.fp8_linear_triton(x, w, w_scale, None),
             nbytes(x, w, w_scale), per_token, FP8_ERR),
        Impl("fp8 static linear", "fp8",
             lambda: torch.ops.qrt.fp8_static_linear_triton(x, w, w_scale, input_scale, None),
             nbytes(x, w, w_scale, input_scale),
             lambda: torch.ops.qrt.fp8_static_linear(x, w, w_scale, input_scale, None), FP8_ERR),
        Impl("fp8 block linear", "fp8",
             lambda: torch.ops.qrt.fp8_block_linear_triton(x, w, block_scale, None, GROUP, GROUP),
             nbytes(x, w, block_scale),
             lambda: torch.ops.qrt.fp8_block_linear(x, w, block_scale, None, GROUP, GROUP), FP8_ERR),
    ]


def random_int_weight(n: int, k: int, bits: int, group: int, device) -> tuple[torch.Tensor, ...]:
    """Random codes with random group scales and zero points in the canonical layout
    (int_reference.py): qweight int32 [K * bits / 32, N], scales and zeros bf16 [K / group, N]."""
    q = torch.randint(0, 2**bits, (k, n), device=device)  # [K, N]
    scales = (torch.rand(k // group, n, device=device) * 0.002 + 0.001).to(torch.bfloat16)  # [K / group, N]
    zeros = torch.randint(0, 2**bits, (k // group, n), device=device).to(torch.bfloat16)  # [K / group, N]
    return pack_rows(q, bits), scales, zeros


def int_impls(x: torch.Tensor, w_bf16: torch.Tensor) -> list[Impl]:
    n, k = w_bf16.shape
    impls = []
    for name, bits, group in (("W4A16 g128", 4, GROUP), ("W8A16 channel", 8, k)):
        qweight, scales, zeros = random_int_weight(n, k, bits, group, x.device)
        args = (x, qweight, scales, zeros, None, None, bits, group)
        impls.append(Impl(name, "bf16", lambda a=args: torch.ops.qrt.int_linear_triton(*a),
                          nbytes(x, qweight, scales, zeros), lambda a=args: torch.ops.qrt.int_linear(*a), INT_ERR))
    return impls


def int8_impls(x: torch.Tensor, w_bf16: torch.Tensor) -> list[Impl]:
    n, k = w_bf16.shape
    device = x.device
    weight = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)  # [N, K]
    weight_kn = weight.t().contiguous()  # [K, N]: the layout torch._int_mm takes
    weight_scale = torch.rand(n, device=device) * 1e-3 + 1e-4  # [N] fp32
    qweight = pack_rows(torch.randint(0, 16, (k, n), device=device), 4)  # [K / 8, N] int32
    # [K / 128, N] fp32 holding fp16 values, as QQQ's group scales are.
    group_scales = (torch.rand(k // GROUP, n, device=device) * 14 + 1).half().float()
    norm_weight = torch.randn(k, device=device, dtype=torch.bfloat16) * 0.1 + 1  # [K]
    w8a8 = (x, weight, weight_scale, None, None, None, None)
    w4a8 = (x, qweight, group_scales, weight_scale, None, GROUP)

    def int_mm():
        q, scale, _ = quantize_rows_int8(x)  # [M, K] int8, [M, 1] fp32
        return (torch._int_mm(q, weight_kn).float() * scale * weight_scale).to(x.dtype)

    def fused_norm_gemm():
        q, scale = torch.ops.qrt.rms_norm_quant_int8_triton(x, norm_weight, NORM_EPS, False)  # [M, K] int8, [M, 1]
        return torch.ops.qrt.int8_gemm_triton(q, scale, weight, weight_scale, None, x.dtype)

    impls = [
        Impl("W8A8", "int8", lambda: torch.ops.qrt.int8_linear_triton(*w8a8), nbytes(x, weight, weight_scale),
             lambda: torch.ops.qrt.int8_linear(*w8a8), INT8_ERR),
        Impl("W4A8 g128", "int8", lambda: torch.ops.qrt.w4a8_linear_triton(*w4a8),
             nbytes(x, qweight, group_scales, weight_scale), lambda: torch.ops.qrt.w4a8_linear(*w4a8), INT8_ERR),
        Impl("RMSNorm+quant, W8A8 GEMM", "int8", fused_norm_gemm, nbytes(x, norm_weight, weight, weight_scale),
             lambda: torch.ops.qrt.int8_linear(rms_norm(x, norm_weight, NORM_EPS), *w8a8[1:]), INT8_ERR),
    ]
    if device.type != "cuda" or x.shape[0] > 16:  # cuBLAS's int8 GEMM behind _int_mm needs M > 16
        impls.append(Impl("torch._int_mm", "int8", int_mm, nbytes(x, weight_kn, weight_scale)))
    return impls


SECTION_IMPLS = {"fp8": fp8_impls, "int": int_impls, "int8": int8_impls}


def make_cases(shapes, rows, sections: list[str], device: torch.device) -> list[Case]:
    """Inputs and implementations of every size; each holds its own tensors until the run ends."""
    cases = []
    for n, k in shapes:
        w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02  # [N, K]
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # [M, K]
            impls = bf16_impls(x, w_bf16)
            for section in sections:
                if section in SECTION_IMPLS:
                    impls += SECTION_IMPLS[section](x, w_bf16)
            cases.append(Case(m, n, k, impls))
    return cases


def check(case: Case, impl: Impl) -> bool:
    """Prints one "check" line: the worst error relative to the reference's largest output."""
    label = f"check {impl.name} M={case.m} N={case.n} K={case.k}"
    try:
        out, ref = impl.run().float(), impl.reference().float()
    except Exception as e:  # noqa: BLE001  (a kernel that raises fails its check; the rest still run)
        print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0]} FAILED")
        return False
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    ok = err <= impl.max_err
    print(f"{label}: max err / max |ref| = {err:.2e} {'ok' if ok else 'FAILED'}")
    return ok


def measure_ceilings(flush: torch.Tensor) -> dict[str, float]:
    """HBM read bytes/s and dense FLOP/s (OP/s for int8) of torch's own ops on this card."""
    data = torch.ones(HBM_CEILING_BYTES // 4, device="cuda")  # [512 Mi] fp32: 2 GiB, ~40x L2
    s = CEILING_SIZE
    a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)  # [8192, 8192]
    a_fp8 = a.to(FP8_DTYPE)  # [8192, 8192]
    one = torch.ones((), device="cuda")  # per-tensor scale: the fastest _scaled_mm path
    a_int8 = torch.randint(-127, 128, (s, s), device="cuda", dtype=torch.int8)  # [8192, 8192]
    flop = 2 * s**3

    def seconds(fn) -> float:
        return time_us(fn, WARMUP, REPS, flush) / 1e6

    return {
        "hbm": HBM_CEILING_BYTES / seconds(data.sum),
        "bf16": flop / seconds(lambda: torch.matmul(a, a)),
        # fp8 MMAs want the second operand K-major: a column-major view of a row-major matrix.
        "fp8": flop / seconds(lambda: torch._scaled_mm(a_fp8, a_fp8.t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16)),
        "int8": flop / seconds(lambda: torch._int_mm(a_int8, a_int8)),
    }


def print_ceilings(ceilings: dict[str, float] | None) -> None:
    if ceilings is None:
        print("ceilings: skipped (--smoke); the fraction columns stay empty")
        return
    print(f"ceilings, measured: HBM {ceilings['hbm'] / 1e12:.2f} TB/s (sum over 2 GiB); dense "
          f"{CEILING_SIZE}³: bf16 {ceilings['bf16'] / 1e12:.0f} TFLOP/s (torch.matmul), "
          f"fp8 {ceilings['fp8'] / 1e12:.0f} TFLOP/s (torch._scaled_mm), "
          f"int8 {ceilings['int8'] / 1e12:.0f} TOP/s (torch._int_mm)")


HEADER = (f"{'M':>5} {'N x K':>11}  {'impl':<24} {'µs':>9} {'TFLOP/s':>8} {'TB/s':>6} {'of HBM':>7} "
          f"{'of MMA':>7}  MMA")


def time_row(case: Case, impl: Impl, warmup: int, reps: int, flush, ceilings) -> str:
    head = f"{case.m:>5} {f'{case.n}x{case.k}':>11}  {impl.name:<24}"
    # An op that fails here (a torch baseline this build or card lacks at some M, a kernel that
    # failed its check) costs only its row, not the rest of a run on a borrowed GPU.
    try:
        us = time_us(impl.run, warmup, reps, flush)
    except Exception as e:  # noqa: BLE001
        return f"{head} failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    flops = 2 * case.m * case.n * case.k / us * 1e6
    bytes_s = (impl.reads + 2 * case.m * case.n) / us * 1e6  # + the bf16 output [M, N]
    hbm = "—" if ceilings is None else f"{bytes_s / ceilings['hbm']:.0%}"
    mma = "—" if ceilings is None else f"{flops / ceilings[impl.mma]:.0%}"
    return f"{head} {us:>9.1f} {flops / 1e12:>8.1f} {bytes_s / 1e12:>6.2f} {hbm:>7} {mma:>7}  {impl.mma}"


def decode_table(hbm_bytes_s: float) -> None:
    """Decode tok/s of the ~1B Llama in each format, and that over its roofline."""
    path = random_llama_path()
    ids = prompt_ids(LLAMA_1B["vocab_size"], PROMPT_TOKENS)
    print(f"\ndecode, {path.name}: {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, median of "
          f"{DECODE_RUNS} [min–max]; roofline = HBM ceiling / weight bytes per step")
    print(f"{'quant':<6} {'load+compile s':>14} {'weights GB':>10} {'decode tok/s':>22} {'of roofline':>11}")
    for name, quant in DECODE_QUANTS.items():
        started = time.perf_counter()
        model = compile_model(path, quant=quant, device="cuda", progress=False)  # compiles prefill and decode now
        ready_s = time.perf_counter() - started
        causal_lm = model.model
        weight_bytes = weight_bytes_per_token(causal_lm, getattr(causal_lm.model.embed_tokens, "weight", None))

        def generate(n: int) -> list[list[float]]:
            clock = TokenClock()
            check_length(model.generate(ids, max_new_tokens=n, stop_at_eos=False, stream=clock.tick), n, f"qrt {name}")
            return clock.rows()

        # NEW_TOKENS + 1: the first new token comes from the prefill, the other NEW_TOKENS are decode
        # steps, timed from the first token to the last as they stream out.
        figures = speeds(timed_runs(lambda: generate(1), DECODE_RUNS),
                         timed_decodes(lambda: generate(NEW_TOKENS + 1), DECODE_RUNS), PROMPT_TOKENS)
        tok_s = figures["decode_tok_s"]
        spread = f"{tok_s['median']:.1f} [{tok_s['min']:.1f}–{tok_s['max']:.1f}]"
        print(f"{name:<6} {ready_s:>14.1f} {weight_bytes / 1e9:>10.2f} {spread:>22} "
              f"{tok_s['median'] * weight_bytes / hbm_bytes_s:>11.0%}")
        del model, causal_lm
        gc.collect()
        torch.cuda.empty_cache()  # so the next model is measured with only itself on the card


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes, runs on the CPU under TRITON_INTERPRET=1; no ceilings, no decode")
    parser.add_argument("--only", type=name_list(SECTIONS), default=list(SECTIONS),
                        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        rows, shapes, warmup, reps = SMOKE_ROWS, SMOKE_SHAPES, SMOKE_WARMUP, SMOKE_REPS
    elif device.type != "cuda":
        parser.error("no GPU: full sizes need CUDA; use --smoke with TRITON_INTERPRET=1 on a CPU")
    else:
        rows, shapes, warmup, reps = ROWS, SHAPES, WARMUP, REPS
    on_gpu = device.type == "cuda"
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device) if on_gpu else None
    print(f"device: {torch.cuda.get_device_name() if on_gpu else 'cpu'}")
    ceilings = measure_ceilings(flush) if on_gpu and not args.smoke else None
    print_ceilings(ceilings)

    torch.manual_seed(0)
    ok = True
    if any(section in SECTION_IMPLS for section in args.only):
        cases = make_cases(shapes, rows, args.only, device)
        for case in cases:
            for impl in case.impls:
                if impl.reference is not None:
                    ok &= check(case, impl)
        print(HEADER)
        for case in cases:
            for impl in case.impls:
                print(time_row(case, impl, warmup, reps, flush, ceilings), flush=True)
        del cases
    if "decode" in args.only:
        if args.smoke:
            print("decode: skipped (--smoke: a 1B model needs a GPU)")
        else:
            decode_table(ceilings["hbm"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
