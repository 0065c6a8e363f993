"""qrt's superblock kernel (llama.cpp's block types at their own width) against the kernels the
same GGUF weights ran on before it, at decode shape (M = 1).

    python -m bench.probes.cpu_superblock_options [--threads 2] [--rounds 9] [--shapes 8960x1536,2048x2048]

For each [N, K] and each of Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K (random blocks of the type,
decoded by qrt's GGUF loader code), two kernels on the same weights:
- superblock: `qrt_cpu::superblock_linear` on the codes at their own width with the file's scales;
- before: what the loader chose before it, on the exact integer decoding of the same blocks: the
  int4 kernel (`qrt_cpu::int4_pairs_linear`, a bf16 scale and offset per group) for the 4-bit types,
  the byte-wide grouped kernel (`qrt_cpu::int8_groups_linear`) for the 5- and 6-bit ones.
Each call takes the next copy from a ring of 512 MiB (every call reads its weight from memory, as
a decode step does); `--in-cache` times one copy over and over instead (the kernels' instruction
cost). The two alternate in rounds and the ratio is the median of the rounds' (this machine's speed
drifts between minutes). Both are checked against the dequantized weight before they are timed.
"""

import argparse
import statistics
import sys

import torch

from bench.measure import median_us, ring
from qrt.formats.gguf_blocks import BLOCK_TYPES, decode_blocks, superblock_weights
from qrt.kernels import int4_pairs_cpu, int8_groups_cpu, native_cpu, superblock_cpu
from qrt.kernels.int_cpu import pack_int4_for_cpu

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
NEVER = 2**62  # min_rows_dequantized: the exact GEMV route


def random_blocks(ggml_type: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random blocks uint8 [N, K / weights, bytes] whose fp16 scales are of a linear layer's size."""
    kind = BLOCK_TYPES[ggml_type]
    blocks = torch.randint(0, 256, (n, k // kind.weights, kind.bytes), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // kind.weights, 2, generator=gen) * 1e-3).half().view(torch.uint8)  # [N, B, 4]
    at = 208 if ggml_type == "Q6_K" else 0  # where the block's fp16 d (and dmin or m) sit
    width = 2 if ggml_type in ("Q6_K", "Q4_0", "Q5_0") else 4
    blocks[..., at:at + width] = scales[..., :width]
    return blocks


def kernels(ggml_type: str, blocks: torch.Tensor, k: int):
    """{name: (make copies, call)} for the superblock kernel and the one before it."""
    w = superblock_weights(blocks, ggml_type, k)

    def superblock_copy():
        p = superblock_cpu.pack_part(w)
        return (p["codes"], p["sub_scales"], p["sub_offsets"], p["super_scales"], p["super_offsets"])

    def superblock(x, codes, sub_scales, sub_offsets, super_scales, super_offsets):
        return torch.ops.qrt_cpu.superblock_linear(x, codes, w.bits, w.zero, sub_scales, sub_offsets, super_scales,
                                                   super_offsets, w.group_size, None, NEVER)

    iw = decode_blocks(blocks, ggml_type, k)
    if iw.bits == 4:
        def before_copy():
            return pack_int4_for_cpu(iw.q, iw.scales, iw.zeros, iw.group_size, iw.group_size, torch.bfloat16)

        def before(x, packed, scale_offsets):
            return torch.ops.qrt_cpu.int4_pairs_linear(x, packed, scale_offsets, iw.group_size, None, NEVER)
    else:
        centres = int8_groups_cpu.code_centres(iw.q, iw.zeros)  # [N]

        def before_copy():
            return (int8_groups_cpu.pack_codes(iw.q, centres),
                    int8_groups_cpu.pack_scale_offsets(iw.scales, iw.zeros, centres, torch.bfloat16))

        def before(x, packed, scale_offsets):
            return torch.ops.qrt_cpu.int8_groups_linear(x, packed, scale_offsets, None, NEVER)
    return w, {"superblock": (superblock_copy, superblock), "before": (before_copy, before)}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shapes", default="8960x1536,2048x2048", help="N x K, comma-separated")
    parser.add_argument("--in-cache", action="store_true", help="one copy, over and over")
    args = parser.parse_args(argv)
    if not native_cpu.available():
        print(f"qrt's CPU kernels are not available here: {native_cpu.why_unavailable()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, M = 1, {'one copy (in cache)' if args.in_cache else 'weights from memory'}; "
          f"median µs of each kernel over {args.rounds} alternating rounds, the ratio the median of the rounds'")
    print(f"{'type':6} {'N x K':>11} {'superblock µs':>14} {'GB/s':>6} {'× file':>7} {'before µs':>10} {'GB/s':>6} "
          f"{'× file':>7} {'before / superblock':>20}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        for ggml_type in TYPES:
            blocks = random_blocks(ggml_type, n, k, gen)
            w, pair = kernels(ggml_type, blocks, k)
            expected = x.float() @ w.dequantize().t()
            rows, times = {}, {name: [] for name in pair}
            for name, (make, call) in pair.items():
                first = make()
                error = (call(x, *first).float() - expected).norm() / expected.norm()
                assert error < 2e-2, f"{ggml_type} {name}: relative error {error:.3g}"
                rows[name] = ([first] if args.in_cache else ring(make, nbytes(first))), nbytes(first)
            for _ in range(args.rounds):
                for name, (_, call) in pair.items():
                    copies = rows[name][0]
                    times[name].append(median_us(call, [(x, *c) for c in copies], calls=max(50, 2 * len(copies))))
            file_bytes = blocks.numel()
            sb, bf = statistics.median(times["superblock"]), statistics.median(times["before"])
            ratio = statistics.median(b / s for s, b in zip(times["superblock"], times["before"]))
            print(f"{ggml_type:6} {shape:>11} {sb:14.0f} {rows['superblock'][1] / sb / 1e3:6.1f} "
                  f"{rows['superblock'][1] / file_bytes:7.3f} {bf:10.0f} {rows['before'][1] / bf / 1e3:6.1f} "
                  f"{rows['before'][1] / file_bytes:7.3f} {ratio:20.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
