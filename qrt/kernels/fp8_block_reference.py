"""Block fp8 (DeepSeek-V3 / Qwen3-FP8 `weight_block_size`): plain-torch reference and the logical
op `qrt::fp8_block_linear`.

Scheme (docs/formats.md §4.2): the weight is float8_e4m3fn [N, K] with one fp32 multiplier per
block_n x block_k tile, W[n, k] = weight[n, k] * weight_scale[n // block_n, k // block_k];
activations are quantized dynamically per token per group of block_k channels along K. Both grids
use ceil, so the last block of a ragged N or K is partial.

As with `qrt::fp8_linear`, the logical op's implementation is the reference (eager mode is the
oracle) and the swap pass replaces it with a kernel for the device. The CPU kernel
(fp8_block_cpu.py) takes a dense weight, which the loader pass builds with `dequantize_block_fp8`.
"""

import torch

from .exact_division import divide_exactly
from .fp8_reference import FP8_DTYPE, FP8_MAX, MIN_SCALE


def group_spans(k: int, group: int) -> list[tuple[int, int, int]]:
    """Split [0, K) into spans of whole groups: (start, width, group size) for the groups of
    `group` channels, then, when K is ragged, the last partial group as a span of its own."""
    whole = k - k % group
    spans = [(0, whole, group)] if whole else []
    if whole < k:
        spans.append((whole, k - whole, k - whole))
    return spans


def quantize_whole_groups(x32: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x32: [M, W] fp32, W a multiple of group. Returns (q [M, W // group, group] fp8,
    scale [M, W // group] fp32), each group quantized as `quantize_rows_fp8` quantizes a row."""
    xg = x32.reshape(x32.shape[0], -1, group)  # [M, W // group, group]
    scale = divide_exactly(xg.abs().amax(dim=-1), FP8_MAX).clamp(min=MIN_SCALE)  # [M, W // group]
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _per_column(scale: torch.Tensor, group: int, size: int) -> torch.Tensor:
    """Each column's entry of a per-group scale: [R, ceil(size / group)] -> [R, size].

    For eager code (the reference, the loader pass); see fp8_block_cpu.py for why compiled code
    avoids this pattern."""
    return scale.repeat_interleave(group, dim=1)[:, :size]


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric fp8 quantization of a 2-D tensor per row per `group` consecutive columns.

    x: [M, K] any float dtype. Returns (q [M, K] float8_e4m3fn, scale [M, ceil(K / group)] fp32)
    with x[m, k] ≈ q[m, k].float() * scale[m, k // group]. Each group, the last one possibly
    partial, is quantized exactly as `quantize_rows_fp8` quantizes a row.
    """
    x32 = x.float()
    parts = [quantize_whole_groups(x32[:, s : s + w], g) for s, w, g in group_spans(x.shape[1], group)]
    return torch.cat([q.flatten(1) for q, _ in parts], dim=1), torch.cat([sc for _, sc in parts], dim=1)


def dequantize_groups_fp8(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of `quantize_groups_fp8`: q [M, K] fp8, scale [M, G] fp32 -> [M, K] fp32."""
    return q.float() * _per_column(scale, group, q.shape[1])


def dequantize_block_fp8(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dense weight a block-fp8 checkpoint stands for, weight * per-block scale, in `dtype`.

    weight: [N, K] float8_e4m3fn; weight_scale: [ceil(N / block_n), ceil(K / block_k)] fp32.
    Returns [N, K] in dtype. The product is formed in fp32 (as the reference does) and rounded to
    dtype once. The loader pass calls this to build the weight of `qrt::fp8_block_linear_cpu`.
    """
    n, k = weight.shape
    n_blocks, k_blocks = -(-n // block_n), -(-k // block_k)
    if tuple(weight_scale.shape) != (n_blocks, k_blocks):
        raise ValueError(
            f"block fp8: weight {tuple(weight.shape)} with blocks {block_n}x{block_k} needs a "
            f"scale of shape {(n_blocks, k_blocks)}, got {tuple(weight_scale.shape)}"
        )
    row_scale = weight_scale.float().repeat_interleave(block_n, dim=0)[:n]  # [N, Kb] fp32
    return (weight.float() * _per_column(row_scale, block_k, k)).to(dtype)  # [N, K]


def fp8_block_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """y = dequant(quant_groups(x)) @ dequant(weight).T + bias, everything in fp32.

    x: [..., K] bf16/fp16/fp32; weight: [N, K] float8_e4m3fn;
    weight_scale: [ceil(N / block_n), ceil(K / block_k)] fp32; bias: [N] or None.
    Returns [..., N] in x.dtype.
    """
    k = x.shape[-1]
    xq, x_scale = quantize_groups_fp8(x.reshape(-1, k), block_k)  # [M, K] fp8, [M, G] fp32
    x_deq = dequantize_groups_fp8(xq, x_scale, block_k)  # [M, K] fp32
    w_deq = dequantize_block_fp8(weight, weight_scale, block_n, block_k, torch.float32)  # [N, K]
    out = x_deq @ w_deq.t()  # [M, N] fp32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qrt::fp8_block_linear", mutates_args=())
def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """Logical block-fp8 linear op (per-token-group activations × per-block weights)."""
    return fp8_block_linear_reference(x, weight, weight_scale, bias, block_n, block_k)


@fp8_block_linear.register_fake
def _(x, weight, weight_scale, bias, block_n, block_k):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
