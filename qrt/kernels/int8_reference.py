"""Plain-torch reference for int8 activation-quantized linears (W8A8) and the logical op
`qrt::int8_linear` that those layers call.

Scheme:
- weight: int8 [N, K], symmetric, one fp32 scale per output channel (`weight_scale` [N]; a
  checkpoint's per-tensor scale is expanded to its shard's rows by the loader).
- activations are quantized to int8 at run time, x ≈ s * (q - z), in one of three ways:
  - dynamic per token, symmetric: s = max|x_row| / 127, q = clamp(round(x / s), -128, 127), z = 0;
  - dynamic per token, asymmetric: the row's range [min, max] widened to include 0 (as
    compressed-tensors' observers do, so z stays an int8 and q - z fits in 9 bits),
    s = (max - min) / 255, z = round(-128 - min / s), q = clamp(round(x / s) + z, -128, 127);
  - static per tensor: s = `input_scale` [1] and z = `input_zero_point` [1] (0 when absent),
    q = clamp(round(x / s) + z, -128, 127).

The zero-point correction. With W[n, k] = s_w[n] * q_w[n, k]:

    y[m, n] = Σ_k x[m, k] W[n, k] ≈ s[m] s_w[n] Σ_k (q[m, k] - z[m]) q_w[n, k]
            = s[m] s_w[n] (Σ_k q[m, k] q_w[n, k]  -  z[m] Σ_k q_w[n, k])

The first sum is the int8 x int8 -> int32 GEMM; the second is z times the weight's row sums
(`weight_sums`, int32 [N], computed once at load), so asymmetric activations cost one
multiply-subtract per output in the epilogue. Both sums are integers, so they are exact; the
only roundings are the activation quantization and the fp32 epilogue (acc * s) * s_w + bias.
Rounding is half to even everywhere (torch.round).
"""

from dataclasses import dataclass

import torch

from .exact_division import divide_exactly
from .layouts import Layout, Packed

INT8_MIN, INT8_MAX = -128, 127
# Floor of a dynamic scale, so an all-zero row does not divide by zero; small enough that any row
# with a nonzero value above 1e-10 is quantized with its own range.
MIN_SCALE = 1e-12


def quantize_rows_int8(x: torch.Tensor, asymmetric: bool = False):
    """Dynamic per-row int8 quantization of a 2-D tensor.

    x: [R, C] any float dtype. Returns (q [R, C] int8, scale [R, 1] fp32, zero [R, 1] int32 or
    None when symmetric) with x ≈ scale * (q - zero).
    """
    x32 = x.float()
    if asymmetric:
        low = x32.amin(dim=-1, keepdim=True).clamp(max=0.0)
        high = x32.amax(dim=-1, keepdim=True).clamp(min=0.0)
        scale = divide_exactly(high - low, 255.0).clamp(min=MIN_SCALE)  # [R, 1] fp32
        zero = (-128.0 - low / scale).round().clamp(INT8_MIN, INT8_MAX)  # [R, 1], an integer
        q = ((x32 / scale).round() + zero).clamp(INT8_MIN, INT8_MAX)
        return q.to(torch.int8), scale, zero.to(torch.int32)
    scale = divide_exactly(x32.abs().amax(dim=-1, keepdim=True), 127.0).clamp(min=MIN_SCALE)  # [R, 1] fp32
    q = (x32 / scale).round().clamp(INT8_MIN, INT8_MAX)
    return q.to(torch.int8), scale, None


def quantize_static_int8(x: torch.Tensor, input_scale: torch.Tensor, input_zero_point: torch.Tensor | None):
    """int8 quantization with a fixed scale [1] (fp32) and optional zero point [1] (int32).
    Returns q of x's shape, int8, saturated."""
    q = (x.float() / input_scale.float()).round()
    if input_zero_point is not None:
        q = q + input_zero_point.float()
    return q.clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def quantize_activations_int8(x2: torch.Tensor, input_scale, input_zero_point, asymmetric: bool):
    """The activation quantization `qrt::int8_linear` specifies (module docstring).

    x2: [M, K]. Returns (q [M, K] int8, scale [M, 1] fp32, zero [M, 1] int32 or None)."""
    if input_scale is None:
        return quantize_rows_int8(x2, asymmetric)
    q = quantize_static_int8(x2, input_scale, input_zero_point)
    scale = input_scale.float().reshape(1, 1).expand(x2.shape[0], 1)
    zero = None if input_zero_point is None else input_zero_point.to(torch.int32).reshape(1, 1).expand(x2.shape[0], 1)
    return q, scale, zero


def weight_row_sums(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int32 [N], Σ_k q_w[n, k]: the zero-point correction's weight factor."""
    return weight.to(torch.int32).sum(dim=1, dtype=torch.int32)


def exact_int_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b_t[N, K]^T for integer tensors, exact: float64 holds every partial sum of
    int8 products exactly (|sum| < 2**53). Returns float64 [M, N] holding integers."""
    return a.double() @ b_t.double().t()


def check_activation_scheme(input_scale, input_zero_point, weight_sums) -> None:
    """A zero point needs a static scale, and asymmetric activations need the weight sums."""
    static_asymmetric = input_scale is not None and input_zero_point is not None
    if (input_scale is None and input_zero_point is not None) or (
            input_scale is not None and static_asymmetric != (weight_sums is not None)):
        raise ValueError("int8_linear: a zero point needs a static input scale, and asymmetric activations "
                         "(a zero point, or dynamic asymmetric) need weight_sums; static symmetric ones take none")


def int8_linear_reference(x, weight, weight_scale, input_scale, input_zero_point, weight_sums, bias):
    """y = x W^T + bias with int8 activations and weights (module docstring).

    x: [..., K] bf16/fp16/fp32; weight: int8 [N, K]; weight_scale: fp32 [N]; input_scale: [1]
    (static) or None (dynamic per token); input_zero_point: int32 [1] or None; weight_sums: int32
    [N] when the activations are asymmetric, else None; bias: [N] or None. Returns [..., N] in
    x.dtype.
    """
    k = x.shape[-1]
    asymmetric = weight_sums is not None
    check_activation_scheme(input_scale, input_zero_point, weight_sums)
    q, x_scale, zero = quantize_activations_int8(x.reshape(-1, k), input_scale, input_zero_point, asymmetric)
    acc = exact_int_matmul(q, weight)  # [M, N] integers
    if zero is not None:
        acc = acc - zero.double() * weight_sums.double()[None, :]  # the zero-point correction
    out = acc.float() * x_scale * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qrt::int8_linear", mutates_args=())
def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    input_zero_point: torch.Tensor | None,
    weight_sums: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Logical W8A8 linear op (int8 weights per channel, int8 activations; module docstring)."""
    return int8_linear_reference(x, weight, weight_scale, input_scale, input_zero_point, weight_sums, bias)


@int8_linear.register_fake
def _(x, weight, weight_scale, input_scale, input_zero_point, weight_sums, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@dataclass
class Int8Weights:
    """One W8A8 layer's tensors (module docstring), the neutral form the int8 layout packs from.
    Other forms that run as int8 weights (QQQ's 4-bit codes times their group scales) give one
    through `int8_weights()`."""

    weight: torch.Tensor  # int8 [N, K]
    weight_scale: torch.Tensor  # fp32 [N]
    input_scale: torch.Tensor | None = None  # fp32 [1] for static activations
    input_zero_point: torch.Tensor | None = None  # int32 [1] for static asymmetric activations
    weight_sums: torch.Tensor | None = None  # int32 [N] for asymmetric activations

    def int8_weights(self) -> "Int8Weights":
        return self


class Int8RowsLayout(Layout):
    """int8 weights [N, K] with fp32 channel scales, as every W8A8 checkpoint stores them; the
    layer calls `qrt::int8_linear` and the swap pass puts the device's kernel there."""

    name = "int8"

    def pack(self, weights, dtype: torch.dtype) -> Packed:
        w = weights.int8_weights()
        return Packed({"weight": w.weight, "weight_scale": w.weight_scale, "input_scale": w.input_scale,
                       "input_zero_point": w.input_zero_point, "weight_sums": w.weight_sums},
                      storage="int8 [N, K], fp32 channel scales")

    def linear(self, layer, x):
        return torch.ops.qrt.int8_linear(x, layer.weight, layer.weight_scale, layer.input_scale,
                                         layer.input_zero_point, layer.weight_sums, layer.bias)


INT8_ROWS = Int8RowsLayout()
