"""Plain-torch reference for fp8 (e4m3) quantization and the logical fp8 linear op.

This is the oracle every fp8 kernel is tested against, and the default implementation of
`qrt::fp8_linear`, the op that quantized layers call in `forward`. Eager mode therefore always
runs the reference; the swap pass replaces the op with a kernel for the device.

Scheme: weights per output channel (one fp32 scale per row), activations dynamically per token
(one fp32 scale per row of the flattened input), both symmetric in float8_e4m3fn.
"""

import torch

from .exact_division import divide_exactly

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# Lower bound on a dynamic scale, so an all-zero row does not divide by zero. Same floor as
# vLLM's per-token quantization (1 / (448 * 512)).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


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
