"""Plain-torch reference for fp8 (e4m3) quantization and the logical fp8 linear op.

This is the oracle every fp8 kernel is tested against, and the default implementation of
`qrt::fp8_linear`, the op that quantized layers call in `forward`. Eager mode therefore always
runs the reference; the swap pass replaces the op with a kernel for the device.

Scheme: weights per output channel (one fp32 scale per row), activations dynamically per token
(one fp32 scale per row of the flattened input), both symmetric in float8_e4m3fn.
"""

from dataclasses import dataclass

import torch

from .exact_division import divide_exactly
from .layouts import Layout, Packed

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# Lower bound on a dynamic scale, so an all-zero row does not divide by zero. Same floor as
# vLLM's per-token quantization (1 / (448 * 512)).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

# How an fp8 layer's activations are quantized, which picks its logical op (`fp8_linear`,
# `fp8_static_linear`, `fp8_block_linear`).
DYNAMIC_TOKEN = "dynamic per token"
STATIC_TENSOR = "static per tensor"
DYNAMIC_GROUP = "dynamic per token-group"


@dataclass
class Fp8Weights:
    """One layer's fp8 weights as loaded, the neutral form the fp8 layouts pack from."""

    codes: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # fp32: [N] per channel (per-tensor scales expanded), or the block grid [N / bn, K / bk]
    scale_name: str  # the layer's parameter that holds `scale`
    block: tuple[int, int] | None = None  # (rows, cols) a block scale covers; None without blocks


class Fp8CodesLayout(Layout):
    """The e4m3 codes [N, K] as stored, which the reference ops and the fp8 kernels read. The
    layer calls the logical op of its activations; the swap pass puts the device's kernel there."""

    name = "fp8"

    def pack(self, weights: Fp8Weights, dtype: torch.dtype) -> Packed:
        return Packed({"weight": weights.codes}, storage="fp8_e4m3 [N, K]")

    def linear(self, layer, x, activation: str, scale_name: str):
        return fp8_logical_linear(layer, x, activation, scale_name)


def fp8_logical_linear(layer, x: torch.Tensor, activation: str, scale_name: str) -> torch.Tensor:
    """The logical op of an fp8 layer whose activations are quantized as `activation` says, on
    the layer's weight in whichever form its kernel takes."""
    scale = getattr(layer, scale_name)
    if activation == DYNAMIC_TOKEN:
        return torch.ops.qrt.fp8_linear(x, layer.weight, scale, layer.bias)
    if activation == STATIC_TENSOR:
        return torch.ops.qrt.fp8_static_linear(x, layer.weight, scale, layer.input_scale, layer.bias)
    return torch.ops.qrt.fp8_block_linear(x, layer.weight, scale, layer.bias, *layer.weight_block)


FP8_CODES = Fp8CodesLayout()


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row fp8 quantization of a 2-D tensor.

    x: [R, C] any float dtype. Returns (q [R, C] float8_e4m3fn, scale [R, 1] float32) with
    x ≈ q.float() * scale.
    """
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = divide_exactly(amax, FP8_MAX).clamp(min=MIN_SCALE)  # [R, 1] fp32
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [R, C] fp8
    return q, scale


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y = quant(x) @ weight.T, rescaled per token and per channel, plus bias.

    x: [..., K] bf16/fp16/fp32; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32;
    bias: [N] or None. Returns [..., N] in x.dtype. Products are summed in fp32.
    """
    k = x.shape[-1]
    xq, x_scale = quantize_rows_fp8(x.reshape(-1, k))  # [M, K] fp8, [M, 1] fp32
    acc = xq.float() @ weight.float().t()  # [M, N] fp32
    out = acc * x_scale * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qrt::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Logical fp8 linear op (per-token activations × per-channel weights)."""
    return fp8_linear_reference(x, weight, weight_scale, bias)


@fp8_linear.register_fake
def _(x, weight, weight_scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
