"""qrt's CPU kernel for integer weights of up to 8 bits stored a byte a code, with a scale and an
offset per group along K: `qrt::int8_groups_linear`, on `qrt_cpu::int8_groups_linear`
(csrc/int8_groups_cpu.cpp). It takes the 8-bit weights in groups that neither other integer CPU
kernel runs (int4pack is 4-bit only, int8pack has one scale per channel): GPTQ 8-bit g128, and
codes of 5 or 6 bits (GGUF's Q5_K, Q6_K) or 8 (Q8_0) that arrive as `IntWeights` with bits = 8.
Otherwise they are dequantized to the model dtype, 2 bytes a bf16 weight; here a byte a weight and
4 / g for the group's scale and offset.

The layout: the codes, less a centre c_n chosen per output, as int8 in the pair layout of the GEMV
kernels (pair_layout.py), [N / 64, K / 2, 64, 2], element (b, j, d, t) = q[2 j + t, n] - c_n with
n = 64 b + d; scale_offsets [N / 64, K / g, 64, 2], the (scale, offset) of output n in group h at
(b, h, d), offset = (c_n - zero) * scale, so W = (q - c_n) * scale + offset = (q - zero) * scale. Any
c_n that keeps q - c_n in int8 is exact in the kernel (int8 widens to bf16 exactly); the one nearest
the output's zero points (their median) makes the offsets small, so rounding them to bf16 costs
least: 0 for symmetric GPTQ (zero 128) and Q6_K-like codes (zero 32). The centre is per output, not
per layer, because a fused layer's shards may come from different formats: GGUF's Q5_K_M fuses q
and k in Q5_1 (codes 0..31, zero points within them) with v in Q8_0 (zero 128), and one centre of 128 would
leave q and k with offsets of ~112 scales, whose bf16 rounding is a 4% error in their weights.

Numerics (bf16 models): scales and offsets rounded to bf16 once, at load time. Below
`MIN_ROWS_DEQUANTIZED` rows the products of the codes with x are exact and summed in fp32 per group,
then scale * sum + offset * sum(x) per group, in the same order at any M there, so a row's result
does not depend on its batch. From there W is rounded to bf16 a tile at a time for oneDNN's GEMM.
fp16 and fp32 models (no bf16 activations for the kernel's products) keep this layout, scales and
offsets in their dtype, and the op dequantizes the weight in their dtype on each call: correct, and
costlier per call than a dense weight; quantized checkpoints on CPUs run in bf16.
"""

import torch

from . import native_cpu, pair_layout
from .choices import Kernel, declare
from .int_reference import IntWeights
from .layouts import Layout, Packed

OUTPUTS_PER_BLOCK = pair_layout.OUTPUTS_PER_BLOCK
# Smaller groups would spend 4 / g bytes a weight on scales and offsets, nearing the dense 2.
MIN_GROUP = 16
# The exact route's cost grows with M, the dequantized one's barely: the int4 kernel on the same loop
# crossed over between 16 and 32 rows, and a rough probe of this one did too (docs/cpu-kernels.md).
MIN_ROWS_DEQUANTIZED = 32
BLOCKS_PER_SLICE = 64  # pack_codes' slice: 4096 outputs

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("int8_groups_linear(Tensor x, Tensor packed, Tensor scale_offsets, Tensor? perm, Tensor? bias) -> Tensor")


def kernel_group(k: int, group_size: int) -> int | None:
    """The group size the kernel runs a weight with K input channels in groups of `group_size` with
    (K itself for one group per channel), or None where it cannot: groups even, of at least
    MIN_GROUP channels, dividing K."""
    group = min(group_size, k)
    if group < MIN_GROUP or group % 2 or k % group:
        return None
    return group


def code_centres(q: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The centres c [N] (int32) subtracted from the unsigned codes q [K, N], one per output: the
    median of its zero points [K / g, N], rounded, moved as little as needed to keep each of its
    q - c within int8."""
    low, high = (bound.int() for bound in torch.aminmax(q, dim=0))  # [N] each
    median = zeros.float().median(dim=0).values.round().int()  # [N]
    return torch.minimum(torch.maximum(median, high - 127), low + 128)


def pack_codes(q: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Codes q [K, N] (unsigned) and centres [N] -> int8 [N / 64, K / 2, 64, 2], element
    (b, j, d, t) = q[2 j + t, n] - c_n with n = 64 b + d."""
    k, n = q.shape
    packed = torch.empty(n // OUTPUTS_PER_BLOCK, k // 2, OUTPUTS_PER_BLOCK, 2, dtype=torch.int8)
    # A slice of outputs at a time and in bytes: whole-weight temporaries were the load's peak on a
    # 49152-row lm_head. q - c wraps modulo 256 in uint8, which read as int8 is q - c itself, as it
    # lies in int8's range.
    wrapped_centres = (centres % 256).to(torch.uint8)  # [N]
    for first in range(0, n // OUTPUTS_PER_BLOCK, BLOCKS_PER_SLICE):
        blocks = slice(first, min(first + BLOCKS_PER_SLICE, n // OUTPUTS_PER_BLOCK))
        outputs = slice(blocks.start * OUTPUTS_PER_BLOCK, blocks.stop * OUTPUTS_PER_BLOCK)
        signed = (q[:, outputs].to(torch.uint8) - wrapped_centres[outputs]).view(torch.int8)  # [K, n']
        packed[blocks] = signed.view(k // 2, 2, -1, OUTPUTS_PER_BLOCK).permute(2, 0, 3, 1)
    return packed


def pack_scale_offsets(scales: torch.Tensor, zeros: torch.Tensor, centres: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Scales and zero points [K / g, N], centres [N] -> (scale, (c_n - zero) * scale) pairs
    [N / 64, K / g, 64, 2] in `dtype`, each block's groups together; the offsets computed in fp32 and
    rounded once."""
    s = scales.float()  # [K / g, N]
    offsets = (centres.float() - zeros.float()) * s  # [K / g, N]
    pairs = torch.stack([s, offsets], dim=-1).to(dtype)  # [K / g, N, 2]
    groups, n, _ = pairs.shape
    return pairs.view(groups, n // OUTPUTS_PER_BLOCK, OUTPUTS_PER_BLOCK, 2).permute(1, 0, 2, 3).contiguous()


def dequantize(packed: torch.Tensor, scale_offsets: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in scale_offsets' dtype: code * scale + offset in fp32, rounded once."""
    blocks, half_k = packed.shape[:2]
    n, k, groups = blocks * OUTPUTS_PER_BLOCK, 2 * half_k, scale_offsets.shape[1]
    codes = packed.permute(0, 2, 1, 3).reshape(n, groups, k // groups)  # [N, groups, g]
    pairs = scale_offsets.permute(0, 2, 1, 3).reshape(n, groups, 2)  # [N, groups, 2]
    return _values(codes, pairs)  # [N, K]


def _values(codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Codes [..., groups, g] and their groups' (scale, offset) [..., groups, 2] -> the weights
    [..., groups * g] in the pairs' dtype: code * scale + offset in fp32, rounded once."""
    scales_offsets = pairs.float()
    values = codes.float() * scales_offsets[..., :1] + scales_offsets[..., 1:]  # [..., groups, g] fp32
    return values.flatten(-2).to(pairs.dtype)


def int8_groups_linear(x, packed, scale_offsets, perm, bias):
    """x: [..., K]; packed: int8 [N / 64, K / 2, 64, 2]; scale_offsets: [N / 64, K / g, 64, 2].
    Returns [..., N] in x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if perm is not None:
        x2 = x2.index_select(1, perm)
    if x.dtype == torch.bfloat16:
        out = torch.ops.qrt_cpu.int8_groups_linear(x2, packed, scale_offsets, bias, MIN_ROWS_DEQUANTIZED)  # [M, N]
    else:
        out = x2 @ dequantize(packed, scale_offsets).t()  # [M, N]
        if bias is not None:
            out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


# CompositeImplicitAutograd: a compiled graph sees the kernel call (or the dequantization) itself.
_lib.impl("int8_groups_linear", int8_groups_linear, "CompositeImplicitAutograd")


class Int8GroupsLayout(Layout):
    """Codes a byte each, centred to int8, in the pair layout, with a scale and an offset per group."""

    name = "int8groups"

    def pack(self, weights: IntWeights, dtype: torch.dtype) -> Packed:
        w = weights
        k = w.q.shape[0]
        group = kernel_group(k, w.group_size)
        centres = code_centres(w.q, w.zeros)  # [N]
        # packed: int8 [N / 64, K / 2, 64, 2]; scale_offsets in the model dtype, [N / 64, K / g, 64, 2].
        # The centres live only in the offsets, which absorb them: nothing else is stored.
        return Packed({"weight": pack_codes(w.q, centres),
                       "scale_offsets": pack_scale_offsets(w.scales, w.zeros, centres, dtype)},
                      storage=f"int8 centred codes in pairs [N/64, K/2, 64, 2], scale+offset [N/64, K/g, 64, 2], "
                              f"g{group}")

    def linear(self, layer, x, bits: int, group_size: int):
        return torch.ops.qrt.int8_groups_linear(x, layer.weight, layer.scale_offsets, layer.perm, layer.bias)

    gathers_rows = True

    def rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """Row n is lane n % 64 of block n // 64 in both tensors: a strided gather of its K codes
        and K / g (scale, offset) pairs, dequantized as `dequantize` does."""
        if layer.perm is not None:  # K permuted (act order): the rows would come out in that order
            raise NotImplementedError("int8groups rows of a weight with permuted input channels")
        packed, scale_offsets = layer.weight, layer.scale_offsets
        k, groups = 2 * packed.shape[1], scale_offsets.shape[1]
        block, lane = ids // OUTPUTS_PER_BLOCK, ids % OUTPUTS_PER_BLOCK
        # Advanced indices apart from the slice between them put the ids' dims first.
        codes = packed[block, :, lane].reshape(*ids.shape, groups, k // groups)  # [..., K / g, g]
        return _values(codes, scale_offsets[block, :, lane])  # [..., K]


declare(Kernel(
    "qrt.int8_groups_linear", devices=("cpu",), serves=("qrt.int_linear",), layout=Int8GroupsLayout(),
    # After int8pack (preference 0), which runs one group per channel where it accepts; before dense.
    preference=10,
    accepts=lambda bits, group_size, k, n, contiguous_groups: (
        contiguous_groups and bits == 8 and n % OUTPUTS_PER_BLOCK == 0 and kernel_group(k, group_size) is not None
        and native_cpu.available()),
    why="CPU: byte-wide codes in groups, a scale and an offset per group, summed exactly by qrt's AVX-512 kernel"))
