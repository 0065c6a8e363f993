"""Ways to run a 4-bit weight-only linear on the CPU at prefill shapes (M = 64 .. 512), against bf16.

    python -m bench.probes.cpu_int4_prefill_options [--threads 2] [--m 64,128,256,512]

For each [N, K] of the default model (576 and 1536 wide) and the 0.85B Llama (2048 and 5632), the
median of 20 calls (after 2 warm-up calls) of:
- bf16: F.linear on a bf16 weight (oneDNN);
- aten int4: `_weight_int4pack_mm_for_cpu` on ATen's CPU pack, groups of 64, qrt's CPU int4 kernel
  today;
- dequant + bf16: the pack turned back into a bf16 weight by a plain-torch function that Inductor
  compiles into one kernel (nibbles from ATen's layout, (q - 8) * scale + offset), then bf16
  F.linear. The dequantization alone is timed too: it is the fixed cost that a large M pays back.
Speeds are given as multiples of bf16's. The relative L2 difference between the two int4 routes is printed: the second rounds the
dequantized weight to bf16, the first keeps it in fp32 inside the kernel. At prefill shapes a
weight is reused over M rows, so the cache does not flatter these figures as it would at M = 1.
Run on a quiet machine.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.measure import median_us

SHAPES = ((1536, 576), (576, 1536), (3072, 576), (5632, 2048), (2048, 5632))  # [N, K]
GROUP = 64
BLOCK_N = 64  # ATen's CPU int4 pack: blocks of 64 output rows, two nibbles per byte (row d, row d + 32)


def median_ms(fn) -> float:
    return median_us(fn, calls=20, warmup=2) / 1e3


def dequantize_aten_int4(packed: torch.Tensor, scale_offsets: torch.Tensor, group: int) -> torch.Tensor:
    """ATen's CPU int4 pack (uint8 [N, K / 2]) and scale_offsets ([K / group, N, 2]) -> bf16 [N, K]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n // BLOCK_N, k, BLOCK_N // 2)  # byte [b, k, d]: rows b*64 + d (low), + 32 (high)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=2).permute(0, 2, 1).reshape(n, k)  # [N, K] in [0, 16)
    scales = scale_offsets[..., 0].t().repeat_interleave(group, dim=1)  # [N, K]
    offsets = scale_offsets[..., 1].t().repeat_interleave(group, dim=1)
    return (codes.to(scale_offsets.dtype) - 8) * scales + offsets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--m", default="64,128,256,512", help="rows (prompt tokens) per call")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dequantize = torch.compile(dequantize_aten_int4, dynamic=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, groups of {GROUP}; ms per call")
    print(f"{'N':>6}{'K':>6}{'M':>5}{'bf16':>9}{'aten int4':>11}{'dequant+bf16':>14}{'dequant':>9}"
          f"{'int4 speed':>13}{'deq speed':>12}{'rel. diff':>11}")
    for n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scale_offsets = (torch.randn(k // GROUP, n, 2) * 0.01).to(torch.bfloat16)
        weight = torch.randn(n, k, dtype=torch.bfloat16)
        assert torch.equal(dequantize_aten_int4(packed, torch.stack(
            [torch.ones(k // GROUP, n), torch.full((k // GROUP, n), 8.0)], -1), GROUP).int(), codes)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            bf16 = median_ms(lambda: F.linear(x, weight))
            aten = median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_offsets))
            fused = median_ms(lambda: F.linear(x, dequantize(packed, scale_offsets, GROUP)))
            alone = median_ms(lambda: dequantize(packed, scale_offsets, GROUP))
            a = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_offsets).float()
            b = F.linear(x, dequantize(packed, scale_offsets, GROUP)).float()
            diff = float((a - b).norm() / a.norm())
            print(f"{n:>6}{k:>6}{m:>5}{bf16:>9.2f}{aten:>11.2f}{fused:>14.2f}{alone:>9.2f}"
                  f"{bf16 / aten:>12.2f}×{bf16 / fused:>11.2f}×{diff:>11.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
