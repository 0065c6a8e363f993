"""CPU kernel of the W8A8 linear op: `qrt::int8_linear_cpu`, on ATen's int8-weight matmul.

Same signature and semantics as `qrt::int8_linear` (int8_reference.py). The activation's codes
minus its zero point, q - z, are integers in [-255, 255], which bf16 holds exactly; multiplied by
the int8 weight in `_weight_int8pack_mm` (AVX-512: int8 weights widened in registers, fp32
multiply-adds) they give the reference's integer sums exactly while those stay below 2**24, and
the zero-point correction needs no term of its own: q - z already carries it. ATen returns the
sums in the activation dtype, so they are rounded once to bf16 (2**-9 relative); that and the
summation order are the only differences from the reference. The weight scale is applied after,
in fp32 (ATen's own scale argument gets ones: it would round the scale to bf16).

Why this GEMM: it streams one byte per weight, and a decode step is a weight-bandwidth-bound
GEMV. `bench/probes/cpu_int8_options.py` times it against the alternatives (`torch._int_mm`, weights
widened to bf16 once at load, an Inductor-fused dequantizing reduction).

CompositeImplicitAutograd: in a compiled graph Inductor fuses the per-token quantization before
and the rescaling after into generated C++ around the one matmul call (`qrt::int8_matmul_cpu`).
"""

from functools import cache

import torch
import torch.nn.functional as F

from .choices import Kernel, declare
from .int8_reference import INT8_ROWS, quantize_activations_int8

# ATen's AVX-512 kernel reads 16 activations at a time and has no tail: K is padded to a multiple.
_K_STEP = 16

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define(
    "int8_linear_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? input_zero_point, "
    "Tensor? weight_sums, Tensor? bias) -> Tensor"
)


@cache
def _unit_scales(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16, device=device)  # [N]


@torch.library.custom_op("qrt::int8_matmul_cpu", mutates_args=())
def int8_matmul_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: bf16 [M, K] (K a multiple of 16) times int8 weight [N, K]^T -> bf16 [M, N].

    Its own opaque op rather than the ATen call inside the composite below: ATen's scale argument
    must be ones here, and in a compiled graph Inductor's lowering of `_weight_int8pack_mm` wants
    that argument as a buffer while it keeps a constant of ones unbuffered (a LoweringException)."""
    return torch.ops.aten._weight_int8pack_mm(x, weight, _unit_scales(weight.shape[0], weight.device))


@int8_matmul_cpu.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


def int8_linear_cpu(x, weight, weight_scale, input_scale, input_zero_point, weight_sums, bias):
    """x: [..., K]; weight: int8 [N, K]; weight_scale: fp32 [N]. Returns [..., N] in x.dtype."""
    k = x.shape[-1]
    n = weight.shape[0]
    q, x_scale, zero = quantize_activations_int8(x.reshape(-1, k), input_scale, input_zero_point,
                                                 weight_sums is not None)  # [M, K] int8, [M, 1], [M, 1]
    grid = q.float() if zero is None else q.float() - zero.float()
    # Only bf16 activations take ATen's vectorised path (fp32 and fp16 fall to a scalar loop).
    grid = grid.to(torch.bfloat16)  # [M, K], exact
    pad = -k % _K_STEP
    if pad:
        # Zero columns add nothing; with freezing the weight's padding is folded at compile time.
        grid, weight = F.pad(grid, (0, pad)), F.pad(weight, (0, pad))
    acc = torch.ops.qrt.int8_matmul_cpu(grid, weight)  # [M, N] bf16
    out = acc.float() * x_scale * weight_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


_lib.impl("int8_linear_cpu", int8_linear_cpu, "CompositeImplicitAutograd")

declare(Kernel(
    "qrt.int8_linear_cpu", devices=("cpu",), serves=("qrt.int8_linear", "qrt.w4a8_linear"),
    replaces="qrt.int8_linear", layout=INT8_ROWS,
    why="CPU: int8 weights in ATen's int8-weight matmul, activations on the int8 grid per token (fused by "
        "Inductor); QQQ's 4-bit codes arrive as the int8 weights they stand for"))
