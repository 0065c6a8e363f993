"""qrt's own CPU kernels (qrt/kernels/csrc/quantized_cpu.cpp) against the ones they replace, by rows M.

    python -m bench.probes.cpu_native_options [--threads 2] [--m 1,8,16,32,64,128,512]

For each [N, K] of the default model (576 and 1536 wide) and the 0.85B Llama (2048 and 5632) and each
M, the median µs of a number of calls, each on another copy of the weights from a ring of 512 MiB,
so that every call reads its weight from memory as a decode step does, of:
- bf16: oneDNN's linear on a prepacked bf16 weight (qrt's bf16 kernel without its own library,
  and the GEMM that the widened-fp8 kernels run);
- bf16 pairs: `qrt_cpu::bf16_linear`, qrt's kernel on the weight packed in pairs (what bf16 runs
  with qrt's library);
- fp8 GEMV / fp8 deq: `qrt_cpu::fp8_linear` with per-channel scales (activations quantized per
  token inside, as the model runs it), forced to its GEMV route or to its dequantize + bf16 GEMM
  route;
- aten int4 / int4 GEMV / int4 deq: ATen's `_weight_int4pack_mm_for_cpu` (groups of 64), and
  `qrt_cpu::int4pack_mm` at M = 1 (its GEMV on the same pack; at M > 1 it calls ATen's kernel, so
  that column is left out) or forced to dequantize + bf16 GEMM;
- aten int8 / int8 GEMV / int8 deq: the same for `_weight_int8pack_mm`, and `qrt_cpu::int8pack_mm`
  forced to its GEMV or to its dequantized route;
- int8 pairs / fp8 pairs: `qrt_cpu::int8_pairs_linear` and `qrt_cpu::fp8_pairs_linear`, qrt's
  kernels on the same codes packed in pairs (what int8, and fp8 per channel in a compiled bf16
  model, run with qrt's library);
- int4 pairs: `qrt_cpu::int4_pairs_linear`, qrt's kernel on the same 4-bit codes and group scales
  in its own pack (what int4 in a bf16 model runs with qrt's library, at every M).
In brackets, each kernel's speed as a multiple of bf16's at the same shape (> 1: faster). Each
route is checked against a float reference before it is timed. Run on a quiet machine.
"""

import argparse
import sys

import torch

from bench.measure import median_us, ring
from qrt.kernels import fp8_pairs_cpu, int4_pairs_cpu, int8_pairs_cpu, native_cpu

SHAPES = ((576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576), (2048, 2048), (11264, 2048),
          (2048, 5632))  # [N, K]
GROUP = 64
ALWAYS, NEVER = 0, 2**62  # min_rows_dequantized forcing one route


def check(name: str, got: torch.Tensor, expected: torch.Tensor, tolerance: float = 5e-2) -> None:
    error = float((got.float() - expected).norm() / expected.norm())
    if error > tolerance:
        raise SystemExit(f"{name} is wrong: relative error {error:.3g}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--m", default="1,8,16,32,64,128,512")
    parser.add_argument("--only", help="comma-separated columns to time (default: all; bf16 always)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native_cpu.available():
        raise SystemExit(f"qrt's CPU kernels are off here: {native_cpu.why_unavailable()}")
    rows = [int(v) for v in args.m.split(",")]
    names = ["bf16", "bf16 pairs", "fp8 GEMV", "fp8 deq", "aten int4", "int4 GEMV", "int4 deq", "aten int8", "int8 GEMV",
             "int8 deq", "int8 pairs", "fp8 pairs", "int4 pairs"]
    print(f"{args.threads} threads; median µs per call [speed × bf16]\n")
    print("| [N, K] | M | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 2))
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.02
        w_bf16 = w.to(torch.bfloat16)
        packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(w_bf16, None)
        pairs_bf16 = torch.ops.qrt_cpu.pack_bf16_pairs(w_bf16)
        w_scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
        w_fp8 = (w / w_scale).to(torch.float8_e4m3fn)
        q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        so = (torch.randn(k // GROUP, n, 2, generator=gen) * 0.01).to(torch.bfloat16)
        pairs4, so_blocked = int4_pairs_cpu.pack_codes(q4.t()), int4_pairs_cpu.pack_scale_offsets(so)
        w8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        s8 = (torch.rand(n, generator=gen) * 0.01).to(torch.bfloat16)
        pairs8 = int8_pairs_cpu.pack_weight(w8)
        pairs_fp8 = fp8_pairs_cpu.pack_weight(w_fp8)
        channel_scale = w_scale.view(-1)  # [N]
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            bf16_expected = x.float() @ w_bf16.float().t()
            fp8_expected = x.float() @ (w_fp8.float() * w_scale).t()
            int4_expected = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, GROUP, so).float()
            int8_expected = torch.ops.aten._weight_int8pack_mm(x, w8, s8).float()
            options = {
                "bf16": (lambda w_: torch.ops.mkldnn._linear_pointwise(x, w_, None, "none", [], ""),
                         lambda: (torch.ops.mkldnn._reorder_linear_weight(w_bf16, None),), 2 * n * k, None),
                "bf16 pairs": (lambda w_: torch.ops.qrt_cpu.bf16_linear(x, w_, None),
                               lambda: (pairs_bf16.clone(),), 2 * n * k, bf16_expected),
                "fp8 GEMV": (lambda w_: torch.ops.qrt_cpu.fp8_linear(x, w_, w_scale, None, 1, k, None, NEVER),
                             lambda: (w_fp8.clone(),), n * k, fp8_expected),
                "fp8 deq": (lambda w_: torch.ops.qrt_cpu.fp8_linear(x, w_, w_scale, None, 1, k, None, ALWAYS),
                            lambda: (w_fp8.clone(),), n * k, fp8_expected),
                "aten int4": (lambda p_: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p_, GROUP, so),
                              lambda: (packed4.clone(),), n * k // 2, None),
                "int4 GEMV": (lambda p_: torch.ops.qrt_cpu.int4pack_mm(x, p_, GROUP, so, NEVER),
                              lambda: (packed4.clone(),), n * k // 2, int4_expected),
                "int4 deq": (lambda p_: torch.ops.qrt_cpu.int4pack_mm(x, p_, GROUP, so, ALWAYS),
                             lambda: (packed4.clone(),), n * k // 2, int4_expected),
                "aten int8": (lambda w_: torch.ops.aten._weight_int8pack_mm(x, w_, s8),
                              lambda: (w8.clone(),), n * k, None),
                "int8 GEMV": (lambda w_: torch.ops.qrt_cpu.int8pack_mm(x, w_, s8, NEVER),
                              lambda: (w8.clone(),), n * k, int8_expected),
                "int8 deq": (lambda w_: torch.ops.qrt_cpu.int8pack_mm(x, w_, s8, ALWAYS),
                             lambda: (w8.clone(),), n * k, int8_expected),
                "int8 pairs": (lambda w_: torch.ops.qrt_cpu.int8_pairs_linear(x, w_, s8, None),
                               lambda: (pairs8.clone(),), n * k, int8_expected),
                "fp8 pairs": (lambda w_: torch.ops.qrt_cpu.fp8_pairs_linear(x, w_, channel_scale, None, None),
                              lambda: (pairs_fp8.clone(),), n * k, fp8_expected),
                "int4 pairs": (lambda p_, s_: torch.ops.qrt_cpu.int4_pairs_linear(
                                   x, p_, s_, GROUP, None, int4_pairs_cpu.MIN_ROWS_DEQUANTIZED),
                               lambda: (pairs4.clone(), so_blocked.clone()), n * k // 2, int4_expected),
            }
            if args.only:
                options = {name: option for name, option in options.items()
                           if name == "bf16" or name in args.only.split(",")}
            calls = 200 if m <= 16 else 40 if m <= 128 else 15
            if m > 1:
                options.pop("int4 GEMV", None)
            figures = {}
            for name, (fn, make, nbytes, expected) in options.items():
                operands = ring(make, nbytes)
                if expected is not None:
                    check(f"{name} at {n}x{k}, M={m}", fn(*operands[0]), expected)
                figures[name] = median_us(fn, operands, calls=calls)
                del operands
            cells = [f"{figures[name]:.0f} [{figures['bf16'] / figures[name]:.2f}]" if name in figures else "—"
                     for name in names]
            print(f"| {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)
        del packed_bf16, pairs_bf16
    return 0


if __name__ == "__main__":
    sys.exit(main())
