"""Check qrt::fp8_linear_triton against the reference on a GPU, then time it against bf16
F.linear and torch._scaled_mm.

    python bench/gpu_fp8.py                                # H100/H200
    TRITON_INTERPRET=1 python bench/gpu_fp8.py --smoke     # CPU: toy sizes, proves the script runs

Weights are [N, K]. "fp8 gemm" (the Triton GEMM alone) and "_scaled_mm" take activations that are
already quantized, so they compare GEMM kernels; "fp8 linear" is the whole op, quantization
included. TB/s counts each implementation's inputs and output once: the least traffic it needs.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.fp8_reference import quantize_rows_fp8  # noqa: E402
from kernels.fp8_triton import fp8_gemm_triton, quantize_rows_fp8_triton  # noqa: E402

ROWS = (1, 16, 256, 4096)
SHAPES = ((4096, 4096), (4096, 14336))  # [N, K]: Llama-3-8B attention output and MLP down proj
SMOKE_ROWS = (1, 5)
SMOKE_SHAPES = ((48, 96),)
# Worst |error| over the largest |output|. Two bf16 steps: the op and the reference each round
# to bf16 from fp32 sums that differ only in order, so they may land one step (<= 2**-7) apart.
MAX_REL_ERR = 2.0**-6


def time_us(fn, warmup: int, reps: int, flush: torch.Tensor | None) -> float:
    """Median time of fn() in µs: CUDA events on a GPU, the wall clock otherwise."""
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
        # Evict the previous run's weight from L2 (a 16 MiB fp8 weight fits in H200's 50 MiB), so
        # it comes from HBM as it would in a model that runs other layers in between.
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def bench_shape(m: int, n: int, k: int, device: torch.device, args, flush) -> bool:
    """Checks the op at one size, prints its table rows; False if the check failed."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # [M, K]
    w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02  # [N, K]
    w, w_scale = quantize_rows_fp8(w_bf16)  # [N, K] fp8, [N, 1] fp32
    w_scale = w_scale.view(-1)  # [N]
    xq, x_scale = quantize_rows_fp8_triton(x)  # [M, K] fp8, [M, 1] fp32

    out = torch.ops.qrt.fp8_linear_triton(x, w, w_scale, None)
    ref = torch.ops.qrt.fp8_linear(x, w, w_scale, None)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    ok = err <= MAX_REL_ERR
    print(f"check M={m} N={n} K={k}: max err / max |ref| = {err:.2e} {'ok' if ok else 'FAILED'}")

    out_bytes = 2 * m * n
    fp8_bytes = m * k + n * k + 4 * (m + n) + out_bytes
    impls = {
        "bf16 F.linear": (lambda: F.linear(x, w_bf16), 2 * (m * k + n * k) + out_bytes),
        "_scaled_mm": (
            lambda: torch._scaled_mm(
                xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16
            ),
            fp8_bytes,
        ),
        "fp8 gemm": (lambda: fp8_gemm_triton(xq, w, x_scale, w_scale, None, torch.bfloat16), fp8_bytes),
        "fp8 linear": (
            lambda: torch.ops.qrt.fp8_linear_triton(x, w, w_scale, None),
            2 * m * k + n * k + 4 * n + out_bytes,
        ),
    }
    for name, (fn, nbytes) in impls.items():
        # One baseline that this torch build lacks should not cost the rest of the table.
        try:
            us = time_us(fn, args.warmup, args.reps, flush)
        except RuntimeError as e:
            print(f"{m:>6} {f'{n}x{k}':>12} {name:>14}  failed: {str(e).splitlines()[0]}")
            continue
        tflops = 2 * m * n * k / us / 1e6
        tbs = nbytes / us / 1e6
        print(f"{m:>6} {f'{n}x{k}':>12} {name:>14} {us:>10.1f} {tflops:>9.1f} {tbs:>7.2f}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, 1 warmup, 3 runs (CPU ok)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        rows, shapes, args.warmup, args.reps = SMOKE_ROWS, SMOKE_SHAPES, 1, 3
    elif device.type != "cuda":
        parser.error("no GPU: full sizes need CUDA; use --smoke with TRITON_INTERPRET=1 on a CPU")
    else:
        rows, shapes = ROWS, SHAPES
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    print(f"{'M':>6} {'N x K':>12} {'impl':>14} {'median µs':>10} {'TFLOP/s':>9} {'TB/s':>7}")
    ok = True
    for n, k in shapes:
        for m in rows:
            ok &= bench_shape(m, n, k, device, args, flush)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
