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

from .fp8_reference import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Weights, fp8_logical_linear
from .choices import Kernel, declare
from .layouts import Layout, Packed
from .onednn_cpu import dense_linear

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define(
    "fp8_linear_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor"
)


def fp8_values_product(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """values [..., K] and weight [N, K], both holding exact fp8 values in the model dtype -> their
    product [..., N]. Its sums reach 448 x 448 per term, past float16's largest value (65504), so
    in float16 the GEMM runs in float32 (exact inputs, unrounded sums) instead of overflowing to
    infinities; bf16 has float32's range."""
    if weight.dtype == torch.float16:
        return dense_linear(values.float(), weight.float())
    return dense_linear(values, weight)


def fp8_linear_cpu(x, weight, weight_scale, bias):
    """x: [..., K]; weight: [N, K] in x.dtype holding fp8 values (dense or prepacked, see
    onednn_cpu.py); weight_scale: [N] fp32."""
    x32 = x.float()
    x_scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # [..., 1]
    x_fp8_values = (x32 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(weight.dtype)
    acc = fp8_values_product(x_fp8_values, weight)  # [..., N]
    out = acc.float() * x_scale * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


_lib.impl("fp8_linear_cpu", fp8_linear_cpu, "CompositeImplicitAutograd")


class WidenedFp8Layout(Layout):
    """The e4m3 codes widened to the model dtype, [N, K]: exact, since e4m3 is a subset of bf16,
    fp16 and fp32. The scales stay apart and multiply the GEMM's output."""

    name = "widened"

    def pack(self, weights: Fp8Weights, dtype: torch.dtype) -> Packed:
        return Packed({"weight": weights.codes.to(dtype)},  # [N, K] model dtype, fp8 values
                      storage=f"{str(dtype).removeprefix('torch.')} [N, K] holding exact fp8 values")

    def linear(self, layer, x, activation: str, scale_name: str):
        return fp8_logical_linear(layer, x, activation, scale_name)


WIDENED_FP8 = WidenedFp8Layout()

declare(Kernel(
    "qrt.fp8_linear_cpu", devices=("cpu",), serves=("qrt.fp8_linear",), replaces="qrt.fp8_linear",
    layout=WIDENED_FP8, prepackable=True,
    why="CPU: no fp8 arithmetic; the loader pass widened the fp8 weights to the model dtype (exact), Inductor fuses "
        "the per-token activation quantization around one GEMM"))
