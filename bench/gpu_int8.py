"""Check the W8A8 and W4A8 Triton kernels against their references on a GPU, then time them against
torch._int_mm (int8 x int8 -> int32, the activation quantization and rescale done by torch ops
around it) and a bf16 F.linear of the same shape; also the fused RMSNorm + quantization kernel
followed by the GEMM-only op against the unfused pair.

    python bench/gpu_int8.py                                # H100/H200
    TRITON_INTERPRET=1 python bench/gpu_int8.py --smoke     # CPU: toy sizes, proves the script runs

Weights are [N, K] random int8 (W8A8) or random 4-bit codes with group multipliers (W4A8 g128).
Times include each implementation's activation quantization. torch._int_mm needs M > 16 on CUDA.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels.int8_fused_triton  # noqa: E402,F401  (registers the Triton ops)
import kernels.int8_triton  # noqa: E402,F401
import kernels.w4a8_triton  # noqa: E402,F401
from bench.gpu_fp8 import time_us  # noqa: E402
from kernels.int8_fused_reference import rms_norm  # noqa: E402
from kernels.int8_reference import quantize_rows_int8, weight_row_sums  # noqa: E402
from kernels.int_reference import pack_rows  # noqa: E402

ROWS = (1, 16, 256, 4096)
SHAPES = ((4096, 4096), (4096, 14336))  # [N, K]
SMOKE_ROWS = (1, 5)
SMOKE_SHAPES = ((48, 256),)
# Worst |error| over the largest |output|: integer sums are exact on both sides; what differs is
# the bf16 rounding of the output (one bf16 step, 2**-7 at the top binade; the interpreter
# truncates instead of rounding) and, for the fused norm, a code on a rounding edge.
MAX_REL_ERR = 2.0**-6


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, m: int, n: int, k: int) -> bool:
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(f"check {name} M={m} N={n} K={k}: max err / max |ref| = {err:.2e} {'ok' if err <= MAX_REL_ERR else 'FAILED'}")
    return err <= MAX_REL_ERR


def bench_shape(m: int, n: int, k: int, device, args, flush) -> bool:
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # [M, K]
    norm_weight = torch.randn(k, device=device, dtype=torch.bfloat16) * 0.1 + 1  # [K]
    weight = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)  # [N, K]
    weight_kn = weight.t().contiguous()  # [K, N] for torch._int_mm
    weight_scale = torch.rand(n, device=device) * 1e-3 + 1e-4  # [N] fp32
    sums = weight_row_sums(weight)
    qweight = pack_rows(torch.randint(0, 16, (k, n), device=device), 4)  # [K / 8, N]
    group_scales = (torch.rand(k // 128, n, device=device) * 14 + 1).half().float()  # [K / 128, N]
    w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02  # [N, K]

    def int_mm():
        q, scale, _ = quantize_rows_int8(x)
        return (torch._int_mm(q, weight_kn).float() * scale * weight_scale).to(x.dtype)

    def fused_norm():
        q, scale = torch.ops.qrt.rms_norm_quant_int8_triton(x, norm_weight, 1e-5)
        return torch.ops.qrt.int8_gemm_triton(q, scale, weight, weight_scale, None, x.dtype)

    ok = True
    for name, fn, ref in [
        ("W8A8 dynamic", lambda: torch.ops.qrt.int8_linear_triton(x, weight, weight_scale, None, None, None, None),
         lambda: torch.ops.qrt.int8_linear(x, weight, weight_scale, None, None, None, None)),
        ("W8A8 dynamic asym", lambda: torch.ops.qrt.int8_linear_triton(x, weight, weight_scale, None, None, sums, None),
         lambda: torch.ops.qrt.int8_linear(x, weight, weight_scale, None, None, sums, None)),
        ("W4A8 g128", lambda: torch.ops.qrt.w4a8_linear_triton(x, qweight, group_scales, weight_scale, None, 128),
         lambda: torch.ops.qrt.w4a8_linear(x, qweight, group_scales, weight_scale, None, 128)),
        ("norm+W8A8 fused", fused_norm,
         lambda: torch.ops.qrt.int8_linear(rms_norm(x, norm_weight, 1e-5), weight, weight_scale, None, None, None,
                                           None)),
    ]:
        ok &= _check(name, fn(), ref(), m, n, k)
    impls = {
        "bf16 F.linear": lambda: F.linear(x, w_bf16),
        "W8A8 dynamic": lambda: torch.ops.qrt.int8_linear_triton(x, weight, weight_scale, None, None, None, None),
        "W8A8 dynamic asym": lambda: torch.ops.qrt.int8_linear_triton(x, weight, weight_scale, None, None, sums, None),
        "W4A8 g128": lambda: torch.ops.qrt.w4a8_linear_triton(x, qweight, group_scales, weight_scale, None, 128),
        "norm, W8A8": lambda: torch.ops.qrt.int8_linear_triton(rms_norm(x, norm_weight, 1e-5), weight, weight_scale,
                                                               None, None, None, None),
        "norm+quant fused, GEMM": fused_norm,
    }
    if device.type != "cuda" or m > 16:
        impls["torch._int_mm"] = int_mm
    for name, fn in impls.items():
        us = time_us(fn, args.warmup, args.reps, flush)
        print(f"{m:>6} {f'{n}x{k}':>12} {name:>24} {us:>10.1f} {2 * m * n * k / us / 1e6:>9.1f}")
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
    print(f"{'M':>6} {'N x K':>12} {'impl':>24} {'median µs':>10} {'TOPS':>9}")
    ok = True
    for n, k in shapes:
        for m in rows:
            ok &= bench_shape(m, n, k, device, args, flush)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
