"""Block fp8 (DeepSeek-V3 / Qwen3-FP8 `weight_block_size`): plain-torch reference, the logical op
`qrt::fp8_block_linear` and its CPU kernel `qrt::fp8_block_linear_cpu`.

Scheme (FORMATS.md section 4.2): the weight is float8_e4m3fn [N, K] with one fp32 multiplier per
block_n x block_k tile, W[n, k] = weight[n, k] * weight_scale[n // block_n, k // block_k];
activations are quantized dynamically per token per group of block_k channels along K. Both grids
use ceil, so the last block of a ragged N or K is partial.

As with `qrt::fp8_linear`, the logical op's implementation is the reference (eager mode is the
oracle) and the swap pass replaces it with a kernel for the device. The CPU kernel takes a dense
weight, which the loader pass builds with `dequantize_block_fp8`.
"""

import torch
import torch.nn.functional as F

from .choices import Kernel, declare
from .fp8_reference import FP8_DTYPE, FP8_MAX, MIN_SCALE


def _group_spans(k: int, group: int) -> list[tuple[int, int, int]]:
    """Split [0, K) into spans of whole groups: (start, width, group size) for the groups of
    `group` channels, then, when K is ragged, the last partial group as a span of its own."""
    whole = k - k % group
    spans = [(0, whole, group)] if whole else []
    if whole < k:
        spans.append((whole, k - whole, k - whole))
    return spans


def _quantize_whole_groups(x32: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x32: [M, W] fp32, W a multiple of group. Returns (q [M, W // group, group] fp8,
    scale [M, W // group] fp32), each group quantized as `quantize_rows_fp8` quantizes a row."""
    xg = x32.reshape(x32.shape[0], -1, group)  # [M, W // group, group]
    scale = (xg.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, W // group]
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _per_column(scale: torch.Tensor, group: int, size: int) -> torch.Tensor:
    """Each column's entry of a per-group scale: [R, ceil(size / group)] -> [R, size].

    For eager code (the reference, the loader pass); see the CPU kernel for why compiled code
    avoids this pattern."""
    return scale.repeat_interleave(group, dim=1)[:, :size]


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric fp8 quantization of a 2-D tensor per row per `group` consecutive columns.

    x: [M, K] any float dtype. Returns (q [M, K] float8_e4m3fn, scale [M, ceil(K / group)] fp32)
    with x[m, k] ≈ q[m, k].float() * scale[m, k // group]. Each group, the last one possibly
    partial, is quantized exactly as `quantize_rows_fp8` quantizes a row.
    """
    x32 = x.float()
    parts = [_quantize_whole_groups(x32[:, s : s + w], g) for s, w, g in _group_spans(x.shape[1], group)]
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


# CPU kernel. Like fp8_cpu.py it is CompositeImplicitAutograd, so under torch.compile AOTAutograd
# decomposes it into aten ops and Inductor fuses the activation fake-quantization around the GEMM.
#
# Its `weight` is not fp8: the loader pass has already replaced it with
# `dequantize_block_fp8(weight, weight_scale, block_n, block_k, model_dtype)`, because the block
# scales vary along K and so cannot be applied after a single GEMM. `weight_scale` is then unused;
# it stays in the signature so the swap pass can replace `qrt::fp8_block_linear` 1:1.
#
# A ragged K (not a multiple of block_k; no checkpoint in use has one) gets a second GEMM for the
# last, partial group rather than one fake-quantized [M, K] tensor, so that every pointwise kernel
# spans whole groups. That keeps clear of an Inductor CPU bug (torch 2.13): its loop split turns
# the extent K of a kernel indexed by k // group into K // group * group and leaves the tail
# columns unwritten (pytorch/pytorch#195582, fix proposed in #196119); a zero-padded
# [M, G, group] view sliced back to K, or scales expanded and sliced to K, hit it.
#
# Numerics: the activations are rounded to fp8 per group exactly as `quantize_groups_fp8` does.
# In fp32 the weight and the dequantized activations equal the reference's, so only the summation
# order differs; in bf16 both GEMM operands carry one extra bf16 rounding (2**-9 relative), and
# the GEMM output one more.
_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define(
    "fp8_block_linear_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, "
    "int block_n, int block_k) -> Tensor"
)


def fp8_block_linear_cpu(x, weight, weight_scale, bias, block_n, block_k):
    """x: [..., K]; weight: [N, K] dequantized in the model dtype; weight_scale: unused."""
    k = x.shape[-1]
    x32 = x.reshape(-1, k).float()  # [M, K]
    out = None
    for start, width, group in _group_spans(k, block_k):
        q, scale = _quantize_whole_groups(x32[:, start : start + width], group)
        x_deq = (q.float() * scale[..., None]).flatten(1).to(weight.dtype)  # [M, width]
        part = F.linear(x_deq, weight[:, start : start + width]).float()  # [M, N] fp32
        out = part if out is None else out + part
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


_lib.impl("fp8_block_linear_cpu", fp8_block_linear_cpu, "CompositeImplicitAutograd")

declare(Kernel(
    "qrt.fp8_block_linear_cpu", devices=("cpu",), serves=("qrt.fp8_block_linear",), replaces="qrt.fp8_block_linear",
    layout="dequantized",
    why="CPU: the loader pass dequantized the blocks (fp8 x block scale, rounded once); Inductor fuses the "
        "per-group activation quantization around one GEMM"))
