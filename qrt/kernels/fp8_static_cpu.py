"""CPU kernel of static-activation fp8, `qrt::fp8_static_linear_cpu`, in place of the logical op
`qrt::fp8_static_linear` (fp8_static_reference.py), for weights the loader pass widened to the
model dtype (exact fp8 values, as in fp8_cpu.py).

CompositeImplicitAutograd, so under torch.compile Inductor fuses the activation quantization and
the rescaling around one GEMM in the model dtype. Numerics equal the reference's up to the GEMM's
summation order and the rounding of its output to the model dtype (in float16 the GEMM itself runs in
float32: fp8_cpu.fp8_values_product).
"""

import torch

from .choices import Kernel, declare
from .fp8_cpu import WIDENED_FP8, fp8_values_product
from .fp8_static_reference import quantize_static_fp8

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define(
    "fp8_static_linear_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor input_scale, "
    "Tensor? bias) -> Tensor"
)


def fp8_static_linear_cpu(x, weight, weight_scale, input_scale, bias):
    """x: [..., K]; weight: [N, K] in the model dtype holding fp8 values (dense or prepacked, see
    onednn_cpu.py); weight_scale: [N] fp32;
    input_scale: [1] fp32."""
    x_fp8_values = quantize_static_fp8(x, input_scale).to(weight.dtype)  # [..., K]
    acc = fp8_values_product(x_fp8_values, weight)  # [..., N]
    out = acc.float() * input_scale.float() * weight_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


_lib.impl("fp8_static_linear_cpu", fp8_static_linear_cpu, "CompositeImplicitAutograd")

declare(Kernel(
    "qrt.fp8_static_linear_cpu", devices=("cpu",), serves=("qrt.fp8_static_linear",),
    replaces="qrt.fp8_static_linear", layout=WIDENED_FP8, prepackable=True,
    why="CPU: no fp8 arithmetic; the loader pass widened the fp8 weights to the model dtype (exact), Inductor fuses "
        "the static-scale activation quantization around one GEMM"))
