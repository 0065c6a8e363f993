"""Check qrt::int_linear_triton (W4A16 g128, W8A16 per channel) against the reference on a GPU,
then time it against a bf16 F.linear of the same shape.

    python bench/gpu_int.py                                # H100/H200
    TRITON_INTERPRET=1 python bench/gpu_int.py --smoke     # CPU: toy sizes, proves the script runs

Weights are [N, K]; the integer weight is random codes with random group scales and zero points
in the canonical layout (int32 words along K). TB/s counts each implementation's inputs and
output once: the least traffic it needs, so at M = 1 it is the fraction of HBM bandwidth reached.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels.int_triton  # noqa: E402,F401  (registers qrt::int_linear_triton)
from bench.gpu_fp8 import time_us  # noqa: E402
from kernels.int_reference import pack_rows  # noqa: E402

ROWS = (1, 16, 256, 4096)
SHAPES = ((4096, 4096), (4096, 14336))  # [N, K]
SMOKE_ROWS = (1, 5)
SMOKE_SHAPES = ((48, 320),)
FORMATS = {"W4A16 g128": (4, 128), "W8A16 channel": (8, -1)}
# Worst |error| over the largest |output|: the kernel dequantizes into bf16 before its MMA, the
# reference stays in fp32; a few bf16 steps.
MAX_REL_ERR = 2.0**-5


def random_int_weight(n: int, k: int, bits: int, group_size: int, device):
    group = k if group_size == -1 else group_size
    groups = -(-k // group)
    q = torch.randint(0, 2**bits, (k, n), device=device)  # [K, N]
    scales = (torch.rand(groups, n, device=device) * 0.002 + 0.001).to(torch.bfloat16)  # [groups, N]
    zeros = torch.randint(0, 2**bits, (groups, n), device=device).to(torch.bfloat16)  # [groups, N]
    return pack_rows(q, bits), scales, zeros, group


def bench_shape(m: int, n: int, k: int, device, args, flush) -> bool:
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # [M, K]
    w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02  # [N, K]
    out_bytes = 2 * m * n
    impls = {"bf16 F.linear": (lambda: F.linear(x, w_bf16), 2 * (m * k + n * k) + out_bytes)}
    ok = True
    for name, (bits, group_size) in FORMATS.items():
        qweight, scales, zeros, group = random_int_weight(n, k, bits, group_size, device)
        args_ = (x, qweight, scales, zeros, None, None, bits, group)
        out = torch.ops.qrt.int_linear_triton(*args_)
        ref = torch.ops.qrt.int_linear(*args_)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ok &= err <= MAX_REL_ERR
        print(f"check {name} M={m} N={n} K={k}: max err / max |ref| = {err:.2e} "
              f"{'ok' if err <= MAX_REL_ERR else 'FAILED'}")
        weight_bytes = qweight.numel() * 4 + scales.numel() * 4  # words + bf16 scales and zeros
        impls[name] = (lambda a=args_: torch.ops.qrt.int_linear_triton(*a), 2 * m * k + weight_bytes + out_bytes)
    for name, (fn, nbytes) in impls.items():
        us = time_us(fn, args.warmup, args.reps, flush)
        print(f"{m:>6} {f'{n}x{k}':>12} {name:>14} {us:>10.1f} {2 * m * n * k / us / 1e6:>9.1f} "
              f"{nbytes / us / 1e6:>7.2f}")
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
