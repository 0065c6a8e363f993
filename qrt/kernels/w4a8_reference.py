"""Plain-torch reference for W4A8 linears (QQQ: 4-bit weights, int8 per-token activations) and the
logical op `qrt::w4a8_linear`.

Canonical layout, written by the QQQ loader pass from QQQ's Marlin-style file layout:
- qweight: int32 [K / 8, N], 4-bit unsigned values q packed along K, LSB-first (`pack_rows`);
  the signed code is q - 8;
- group_scales: fp32 [ceil(K / G), N], each code's multiplier to an int8 weight value:
  w8[k, n] = clamp(round((q[k, n] - 8) * group_scales[k // G, n]), -128, 127);
- channel_scales: fp32 [N].

y[m, n] = s_x[m] * channel_scales[n] * Σ_k x_q[m, k] * w8[k, n] + bias, with the activations
quantized per token, symmetric (`quantize_rows_int8`).

This is QQQ's own arithmetic. Its kernel turns each 4-bit code into an int8 weight with one fp16
fused multiply-add, (q - 8) * s_group + 1152, whose result lies in [1024, 2048) where fp16 steps
by exactly 1: the low byte is round((q - 8) * s_group), ties to even, as here (the product of a
4-bit integer and an fp16 scale is exact in fp32). The int8 x int8 GEMM's int32 sums are then
rescaled per token and per channel. Per-channel QQQ files (G = K) hold signed codes that the
kernel multiplies by 16 (the nibble lands in the high half of a byte); the loader writes them as
group scale 1 and channel scale 16 * s_channel, the same products.
"""

from dataclasses import dataclass

import torch

from .int8_reference import INT8_MAX, INT8_MIN, Int8Weights, exact_int_matmul, quantize_rows_int8
from .int_reference import unpack_rows
from .layouts import Layout, Packed


def w4a8_int8_weights(qweight: torch.Tensor, group_scales: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """The int8 weight values of the canonical layout: int8 [K, N] (K-major, as stored)."""
    codes = unpack_rows(qweight, 4, k).float() - 8.0  # [K, N] in [-8, 7]
    group = torch.arange(k, device=qweight.device) // group_size  # [K]
    return (codes * group_scales.float()[group]).round().clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def w4a8_linear_reference(x, qweight, group_scales, channel_scales, bias, group_size: int) -> torch.Tensor:
    """x: [..., K] bf16/fp16/fp32; canonical W4A8 tensors (module docstring); bias [N] or None.
    Returns [..., N] in x.dtype."""
    k = x.shape[-1]
    w8 = w4a8_int8_weights(qweight, group_scales, group_size, k)  # [K, N]
    q, x_scale, _ = quantize_rows_int8(x.reshape(-1, k))  # [M, K] int8, [M, 1] fp32
    acc = exact_int_matmul(q, w8.t())  # [M, N] integers
    out = acc.float() * x_scale * channel_scales.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[1])


@torch.library.custom_op("qrt::w4a8_linear", mutates_args=())
def w4a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    group_scales: torch.Tensor,
    channel_scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """Logical W4A8 linear op (canonical layout, see the module docstring)."""
    return w4a8_linear_reference(x, qweight, group_scales, channel_scales, bias, group_size)


@w4a8_linear.register_fake
def _(x, qweight, group_scales, channel_scales, bias, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[1])


@dataclass
class W4A8Weights:
    """One W4A8 layer in the canonical layout (module docstring), the neutral form its layouts
    pack from."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    group_scales: torch.Tensor  # fp32 [K / G, N], integer multipliers
    channel_scales: torch.Tensor  # fp32 [N]
    group_size: int  # G

    def int8_weights(self) -> Int8Weights:
        """The int8 weights the codes stand for, for kernels that take W8A8 weights."""
        k = self.group_scales.shape[0] * self.group_size
        return Int8Weights(w4a8_int8_weights(self.qweight, self.group_scales, self.group_size, k).t().contiguous(),
                           self.channel_scales)  # int8 [N, K], fp32 [N]


class CanonicalW4A8Layout(Layout):
    """The canonical layout above, read by this reference and the Triton kernel."""

    name = "packed"

    def pack(self, weights: W4A8Weights, dtype: torch.dtype) -> Packed:
        w = weights
        return Packed({"weight": w.qweight, "group_scales": w.group_scales, "channel_scales": w.channel_scales},
                      storage=f"int4 words along K [K/8, N], g{w.group_size} int8 multipliers, fp32 channel scales",
                      constants={"w4a8_group_size": w.group_size})

    def linear(self, layer, x):
        return torch.ops.qrt.w4a8_linear(x, layer.weight, layer.group_scales, layer.channel_scales, layer.bias,
                                         layer.w4a8_group_size)


CANONICAL_W4A8 = CanonicalW4A8Layout()
