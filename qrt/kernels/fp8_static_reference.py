"""Static-activation fp8 (AutoFP8 / ModelOpt FP8, `activation_scheme: static`): plain-torch
reference and the logical op `qrt::fp8_static_linear`.

Scheme (docs/formats.md §4.2 and §5.2): the weight is float8_e4m3fn [N, K] with one fp32 scale
per output channel (a checkpoint's per-tensor scale is expanded to [N] by the loader, which also
lets fused q/k/v shards keep their own scales exactly); activations are quantized with a fixed
fp32 `input_scale` of shape [1] from the checkpoint, not from the data:
xq = clamp(x / input_scale, ±448) in e4m3, y = (xq @ weight.T) * input_scale * weight_scale + bias.
Fused shards (q/k/v, gate/up) read the same x, so they need one input_scale; vLLM takes the max
of the shards' scales.

As with `qrt::fp8_linear`, the logical op's implementation is the reference (eager mode is the
oracle) and the swap pass replaces it with a kernel for the device: on the CPU
`qrt::fp8_static_linear_cpu` (fp8_static_cpu.py).
"""

import torch

from .fp8_reference import FP8_DTYPE, FP8_MAX


def quantize_static_fp8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """fp8 quantization of x with a given scale, saturating at ±448.

    x: any shape, any float dtype; input_scale: [1] fp32. Returns float8_e4m3fn of x's shape with
    x ≈ q.float() * input_scale where |x| <= 448 * input_scale.
    """
    return (x.float() / input_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_static_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y = quant(x, input_scale) @ weight.T, rescaled per tensor and per channel, plus bias.

    x: [..., K] bf16/fp16/fp32; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32;
    input_scale: [1] fp32; bias: [N] or None. Returns [..., N] in x.dtype. Products are summed
    in fp32.
    """
    k = x.shape[-1]
    xq = quantize_static_fp8(x.reshape(-1, k), input_scale)  # [M, K] fp8
    acc = xq.float() @ weight.float().t()  # [M, N] fp32
    # The same order as fp8_gemm_triton's epilogue: (acc * x_scale) * weight_scale + bias.
    out = acc * input_scale.float() * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qrt::fp8_static_linear", mutates_args=())
def fp8_static_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Logical fp8 linear op with a static per-tensor activation scale."""
    return fp8_static_linear_reference(x, weight, weight_scale, input_scale, bias)


@fp8_static_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
