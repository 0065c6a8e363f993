"""CPU implementation of the fp8 linear op, for weights the loader pass widened to bf16.

`qrt::fp8_linear_cpu` is registered as CompositeImplicitAutograd: it has no opaque kernel, so
when the swap pass puts it in a graph, AOTAutograd decomposes it into aten ops and Inductor fuses
the per-token activation quantization into generated C++ around one bf16 GEMM. Called eagerly it
runs the same ops one by one.

Numerics equal the reference's: activations are rounded to fp8 per token exactly as
`quantize_rows_fp8` does, and the weight holds exact fp8 values, so only the GEMM's summation
order and the rounding of its bf16 output differ.
"""

import torch

from .fp8_reference import FP8_DTYPE, FP8_MAX, MIN_SCALE
from .choices import Kernel, declare
from .onednn_cpu import dense_linear

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define(
    "fp8_linear_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor"
)


def fp8_linear_cpu(x, weight, weight_scale, bias):
    """x: [..., K]; weight: [N, K] in x.dtype holding fp8 values (dense or prepacked, see
    onednn_cpu.py); weight_scale: [N] fp32."""
    x32 = x.float()
    x_scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # [..., 1]
    x_fp8_values = (x32 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(weight.dtype)
    acc = dense_linear(x_fp8_values, weight)  # [..., N]
    out = acc.float() * x_scale * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


_lib.impl("fp8_linear_cpu", fp8_linear_cpu, "CompositeImplicitAutograd")

declare(Kernel(
    "qrt.fp8_linear_cpu", devices=("cpu",), serves=("qrt.fp8_linear",), replaces="qrt.fp8_linear",
    layout="widened", prepackable=True,
    why="CPU: no fp8 arithmetic; the loader pass widened the fp8 weights to the model dtype (exact), Inductor fuses "
        "the per-token activation quantization around one GEMM"))
