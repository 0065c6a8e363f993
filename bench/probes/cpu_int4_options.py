"""Ways to run a 4-bit weight-only linear on the CPU at decode shape (M = 1), against bf16.

    python -m bench.probes.cpu_int4_options [--threads 2]

For each [N, K] of the default model (576 and 1536 wide) and the 0.85B Llama (2048 and 5632), the
median of 200 calls (after 20 warm-up calls), each on another copy of the weights from a ring of
512 MiB, so that every call reads its weight from memory as a decode step does (timing one weight
over and over measures the cache instead), of:
- bf16: F.linear on the bf16 weight (oneDNN), 2 bytes per weight;
- aten int4: `_weight_int4pack_mm_for_cpu`, groups of 32 and 128, qrt's CPU int4 kernel today;
- aten int8: `_weight_int8pack_mm`, 1 byte per weight, for scale;
- inductor int4: a plain-torch dequantizing GEMV over bytes holding two 4-bit codes (low nibble,
  high nibble), groups of 32, compiled by Inductor into one vectorized C++ reduction;
- inductor int4 split: the same with each group's sum of x * q computed first and the scale and
  offset applied per group (sum_k x q s + o sum_k x = s * sum_k x q + o * sum_k x).
Each figure is also given as GB/s of weight bytes read (codes, scales and offsets), the number to
hold against the machine's read bandwidth. Run on a quiet machine.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.measure import median_us, ring

SHAPES = ((576, 576), (3072, 576), (576, 1536), (2048, 2048), (11264, 2048), (2048, 5632))  # [N, K]


def int4_gemv(x, codes, scales, offsets):
    """x [1, K] bf16; codes uint8 [N, K / 2] (low nibble: even k, high nibble: odd k); scales,
    offsets [N, K / G] bf16 with W = q * scale + offset. Returns [1, N] bf16."""
    n, half = codes.shape
    groups = scales.shape[1]
    low = (codes & 0xF).to(torch.bfloat16)  # [N, K / 2]
    high = (codes >> 4).to(torch.bfloat16)
    q = torch.stack([low, high], dim=-1).view(n, groups, -1)  # [N, G, K / G]
    w = q * scales[:, :, None] + offsets[:, :, None]
    return (w.float() * x.view(1, groups, -1).float()).sum(dim=(1, 2)).to(torch.bfloat16)[None]


def int4_gemv_split(x, codes, scales, offsets):
    """As int4_gemv, with each group's dot product taken before its scale and offset."""
    n, half = codes.shape
    groups = scales.shape[1]
    low = (codes & 0xF).to(torch.float32)
    high = (codes >> 4).to(torch.float32)
    q = torch.stack([low, high], dim=-1).view(n, groups, -1)  # [N, G, K / G]
    xg = x.view(1, groups, -1).float()  # [1, G, K / G]
    dots = (q * xg).sum(dim=-1)  # [N, G]
    return ((dots * scales.float()).sum(-1) + offsets.float() @ xg.sum(-1)[0]).to(torch.bfloat16)[None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = torch.compile(int4_gemv, dynamic=False)
    compiled_split = torch.compile(int4_gemv_split, dynamic=False)
    print(f"M = 1, {args.threads} threads, median µs of 200 calls (GB/s of weight bytes)\n")
    header = ["[N, K]", "bf16", "aten int4 g32", "aten int4 g128 (g64 if 128 ∤ K)", "aten int8", "inductor int4 g32",
              "inductor int4 split g32"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    generator = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        x = torch.randn(1, k, generator=generator).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)
        q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
        row = [f"{n}x{k}"]

        def cell(fn, make, nbytes):
            us = median_us(fn, ring(make, nbytes), warmup=20)
            return f"{us:.0f} ({nbytes / us / 1e3:.1f})"

        row.append(cell(F.linear, lambda: (x, w.clone()), 2 * n * k))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K / 2] uint8
        for group in (32, 128 if k % 128 == 0 else 64):
            scale_offsets = torch.randn(k // group, n, 2, generator=generator).to(torch.bfloat16)
            row.append(cell(lambda x, p, so, g=group: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, g, so),
                            lambda: (x, packed.clone(), scale_offsets.clone()), n * k // 2 + scale_offsets.numel() * 2))
        w8 = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        s8 = torch.rand(n, generator=generator).to(torch.bfloat16)
        row.append(cell(torch.ops.aten._weight_int8pack_mm, lambda: (x, w8.clone(), s8), n * k + 2 * n))
        codes = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # [N, K / 2]
        scales = torch.rand(n, k // 32, generator=generator).to(torch.bfloat16)
        offsets = torch.randn(n, k // 32, generator=generator).to(torch.bfloat16)
        expected = (q.view(n, k // 32, 32).float() * scales.float()[..., None]
                    + offsets.float()[..., None]).view(n, k) @ x.float()[0]
        for fn in (compiled, compiled_split):
            got = fn(x, codes, scales, offsets).float()[0]
            error = float((got - expected).norm() / expected.norm())
            if error > 2e-2:
                raise SystemExit(f"{fn} is wrong at {n}x{k}: relative error {error:.3g}")
            row.append(cell(fn, lambda: (x, codes.clone(), scales.clone(), offsets.clone()),
                            n * k // 2 + 4 * n * k // 32))
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
