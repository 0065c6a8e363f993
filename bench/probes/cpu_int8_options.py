"""Ways to run a W8A8 linear (int8 weights per channel, int8 activations per token) on the CPU,
timed at decode (M=1) and prefill (M=32) shapes, to choose the CPU kernel of `qrt::int8_linear`.

    python -m bench.probes.cpu_int8_options                # on a quiet machine: nothing else running
    python -m bench.probes.cpu_int8_options --calls 50     # quicker, noisier

Every option runs under torch.compile with Inductor freezing, as qrt compiles models on the CPU,
and includes the per-token activation quantization; the baseline is a plain bf16 linear. Prints
the median of --calls calls (after 10 warm-up calls) per option and shape, in µs, and how far
each option's output is from the exact reference (relative L2), since they round differently:

- bf16 F.linear: the unquantized layer (oneDNN, weights prepacked by freezing);
- qrt int8_linear_cpu: qrt's kernel: activations on the int8 grid in bf16, int8 weights through
  ATen's `_weight_int8pack_mm` (1 byte per weight; integer sums rounded to bf16 on output);
- widened bf16 weights: the same activation grid, weights widened to bf16 once at load (exact
  values, 2 bytes per weight), one oneDNN bf16 GEMM;
- torch._int_mm: int8 activations x int8 weights -> int32, exact sums;
- int8pack, fp32 activations: ATen's int8-weight matmul fed fp32 (exact sums, no vectorised path);
- Inductor dequantizing reduction: (x_grid * w_int8.float()).sum(-1), generated C++.
"""

import argparse
import os

import torch
import torch.nn.functional as F

from bench.measure import median_us
import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.int8_reference import int8_linear_reference, quantize_rows_int8

SHAPES = ((1536, 576), (576, 1536), (2048, 2048))  # [N, K]: SmolLM2 MLP up/down, a 1B-class square
ROWS = (1, 32)  # M: a decode step, a short prompt


def _grid(x):
    q, scale, _ = quantize_rows_int8(x)  # [M, K] int8, [M, 1] fp32
    return q, scale


def candidates(weight: torch.Tensor, weight_scale: torch.Tensor) -> dict:
    """name -> function of x [M, K] bf16 returning [M, N] bf16."""
    w_bf16 = weight.to(torch.bfloat16)  # exact: int8 values are bf16 values
    w_kn = weight.t().contiguous()  # [K, N] int8 for _int_mm
    dense = (weight.float() * weight_scale[:, None]).to(torch.bfloat16)  # the unquantized stand-in
    ones = torch.ones(weight.shape[0])

    def widened(x):
        q, scale = _grid(x)
        return (F.linear(q.to(torch.bfloat16), w_bf16).float() * scale * weight_scale).to(x.dtype)

    def int_mm(x):
        q, scale = _grid(x)
        return (torch._int_mm(q, w_kn).float() * scale * weight_scale).to(x.dtype)

    def int8pack_fp32(x):
        q, scale = _grid(x)
        return (torch.ops.aten._weight_int8pack_mm(q.float(), weight, ones) * scale * weight_scale).to(x.dtype)

    def reduction(x):
        q, scale = _grid(x)
        return ((q.float()[:, None, :] * weight.float()[None]).sum(-1) * scale * weight_scale).to(x.dtype)

    return {
        "bf16 F.linear": lambda x: F.linear(x, dense),
        "qrt int8_linear_cpu": lambda x: torch.ops.qrt.int8_linear_cpu(x, weight, weight_scale, None, None, None, None),
        "widened bf16 weights": widened,
        "torch._int_mm": int_mm,
        "int8pack, fp32 activations": int8pack_fp32,
        "Inductor dequantizing reduction": reduction,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; median µs per call")
    print(f"{'N x K':<12} {'M':>3}  {'option':<32} {'µs':>10}  {'rel. L2 vs exact':>16}")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)  # [N, K]
        weight_scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4  # [N] fp32
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)  # [M, K]
            exact = int8_linear_reference(x.float(), weight, weight_scale, None, None, None, None)
            for name, fn in candidates(weight, weight_scale).items():
                with torch.no_grad(), torch._inductor.config.patch(freezing=True):
                    compiled = torch.compile(fn, fullgraph=True)
                    out = compiled(x)
                    us = median_us(lambda: compiled(x), calls=args.calls)
                error = float((out.double() - exact.double()).norm() / exact.double().norm())
                print(f"{n}x{k:<7} {m:>3}  {name:<32} {us:10.1f}  {error:16.2e}", flush=True)
                torch._dynamo.reset()  # each option compiles on its own


if __name__ == "__main__":
    main()
