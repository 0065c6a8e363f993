"""CPU kernels for integer weight-only linears, on ATen's packed int4 and int8 matmuls.

ATen's CPU kernels want their own layouts and conventions, which the loader pass produces from
the canonical layout (int_reference.py) with the `pack_*` functions below:

- `qrt::int4pack_linear`: `_weight_int4pack_mm_for_cpu`, 4-bit weights in groups of 32, 64, 128
  or 256 along K (N a multiple of 16), or qrt's own kernel on codes packed for it where it runs
  (int4_pairs_cpu.py: bf16 models, N a multiple of 64). The dequantization is W = (q - 8) * scale
  + offset, a float offset per group rather than an integer zero point; (q - z) * s = (q - 8) * s
  + (8 - z) * s, so offset = (8 - z) * s.
- `qrt::int8pack_linear`: `_weight_int8pack_mm`, signed int8 weights with one scale per output
  channel and no zero point (or qrt's own kernel on the codes packed in pairs, int8_pairs_cpu.py,
  where it runs). An asymmetric channel (zero point z != 128 in unsigned units) becomes
  (q - 128) * s - (z - 128) * s: the second term times sum(x) is subtracted after the matmul.

Both ops are CompositeImplicitAutograd, so in a compiled graph Inductor sees the matmul call and
fuses the gathers, corrections and bias around it. Where qrt's own CPU kernels build
(native_cpu.py), that call is qrt's: `qrt_cpu::int4_pairs_linear` on codes in its own pack, or
`qrt_cpu::int4pack_mm` / `int8pack_mm` on ATen's packs (ATen's kernel below
`MIN_ROWS_DEQUANTIZED` rows, and from there the codes dequantized to bf16 and one oneDNN GEMM,
which is faster for prompts; bench/probes/cpu_native_options.py). The choice is made inside the op, at
run time, so a prefill graph with a dynamic length needs no guard on it. Otherwise the ATen call
itself (see passes/backend.py for how the int4 call is lowered in graphs without frozen weights).
Scales must have the activations' dtype (ATen requires it), so they are rounded to the model
dtype once, at load time.
"""

import torch

from . import int4_pairs_cpu, native_cpu, pair_layout
from .choices import Kernel, declare
from .int_reference import IntWeights
from .layouts import Layout, Packed

INT4_CPU_GROUPS = (256, 128, 64, 32)
# From this many rows on, dequantizing to bf16 and oneDNN's GEMM beat ATen's int4 and int8 kernels
# (bench/probes/cpu_native_options.py; docs/cpu-kernels.md).
MIN_ROWS_DEQUANTIZED = 64

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define(
    "int4pack_linear(Tensor x, Tensor packed, Tensor scale_offsets, Tensor? perm, Tensor? bias, int group_size) -> Tensor"
)
_lib.define("int8pack_linear(Tensor x, Tensor weight, Tensor scales, Tensor? zero_terms, Tensor? bias) -> Tensor")


def int4_cpu_group(k: int, n: int, group_size: int) -> int | None:
    """The group size the int4 CPU kernel can run a [K, N] weight with, or None if it cannot.

    A coarser group is split into finer ones that repeat its scale and zero (exact), so a weight
    with groups of G runs with the largest supported size dividing both G and K."""
    if n % 16:
        return None
    return next((g for g in INT4_CPU_GROUPS if group_size % g == 0 and k % g == 0), None)


def pack_int4_for_cpu(q, scales, zeros, group_size: int, cpu_group: int, dtype):
    """4-bit codes q [K, N] (integers in [0, 16)) and their groups' scales and zeros [K / group_size,
    N] -> (packed codes, scale_offsets in `dtype`): for qrt's int4 kernel where it runs
    (int4_pairs_cpu.py: uint8 [N / 64, K / 2, 64], [N / 64, K / cpu_group, 64, 2]), else ATen's CPU
    pack (uint8 [N, K / 2], [K / cpu_group, N, 2])."""
    k = q.shape[0]
    # Row j of the finer grid belongs to group (j * cpu_group) // group_size of the checkpoint.
    source = torch.arange(k // cpu_group) * cpu_group // group_size  # [K / cpu_group]
    s, z = scales.float()[source], zeros.float()[source]  # [K / cpu_group, N] fp32
    scale_offsets = torch.stack([s, (8.0 - z) * s], dim=-1).to(dtype)  # [K / cpu_group, N, 2]
    if int4_pairs_cpu.packable(q.shape[1], k, cpu_group, dtype):
        return int4_pairs_cpu.pack_codes(q), int4_pairs_cpu.pack_scale_offsets(scale_offsets)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.t().to(torch.int32).contiguous(), 1), scale_offsets


def pack_int8_for_cpu(q, scales, zeros, dtype):
    """Unpacked 8-bit per-channel codes q [K, N] (integers in [0, 256)) -> (int8 codes, scales [N],
    zero_terms [N] or None), scales and zero terms in `dtype`; zero_terms is None when every zero
    point is 128. The codes are packed in pairs, [N / 64, K / 2, 64, 2], where qrt's int8 kernel
    runs them (int8_pairs_cpu.py), else [N, K] for ATen's layout."""
    k, n = q.shape
    codes = q.to(torch.uint8)  # narrowed first: int32 temporaries of a 49152-row lm_head were a load's peak
    # q - 128 as int8 is the code's byte with its top bit flipped, written straight into the
    # layout (one copy): element (b, j, d, t) of the pairs is q[2 j + t, 64 b + d].
    if pair_layout.packable(codes.t(), torch.uint8, dtype):
        weight = torch.empty(n // 64, k // 2, 64, 2, dtype=torch.uint8)  # [N / 64, K / 2, 64, 2]
        torch.bitwise_xor(codes.view(k // 2, 2, n // 64, 64).permute(2, 0, 3, 1), 0x80, out=weight)
    else:
        weight = torch.empty(n, k, dtype=torch.uint8)  # [N, K]
        torch.bitwise_xor(codes.t(), 0x80, out=weight)
    s, z = scales.float()[0], zeros.float()[0]  # [N] fp32: one group spans K
    zero_terms = None if bool((z == 128).all()) else ((z - 128.0) * s).to(dtype)
    return weight.view(torch.int8), s.to(dtype), zero_terms


def int4pack_linear(x, packed, scale_offsets, perm, bias, group_size: int):
    """x: [..., K] in scale_offsets' dtype; packed: uint8 [N, K / 2] (ATen's pack) or
    [N / 64, K / 2, 64] (qrt's, int4_pairs_cpu.py). Returns [..., N]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if perm is not None:
        x2 = x2.index_select(1, perm)
    if int4_pairs_cpu.is_packed(packed):
        out = torch.ops.qrt_cpu.int4_pairs_linear(x2, packed, scale_offsets, group_size, bias,
                                                  int4_pairs_cpu.MIN_ROWS_DEQUANTIZED)  # [M, N]
        return out.reshape(*x.shape[:-1], int4_pairs_cpu.output_features(packed))
    if native_cpu.available():
        out = torch.ops.qrt_cpu.int4pack_mm(x2, packed, group_size, scale_offsets, MIN_ROWS_DEQUANTIZED)  # [M, N]
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scale_offsets)  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def int8pack_linear(x, weight, scales, zero_terms, bias):
    """x: [..., K] in scales' dtype; weight: int8 [N, K], or packed in pairs. Returns [..., N]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    fused_bias = None
    if pair_layout.is_pair_packed(weight):
        # The bias is added in the kernel unless the zero-point correction comes between.
        fused_bias = bias if zero_terms is None else None
        out = torch.ops.qrt_cpu.int8_pairs_linear(x2, weight, scales, fused_bias)  # [M, N]
    elif native_cpu.available():
        out = torch.ops.qrt_cpu.int8pack_mm(x2, weight, scales, MIN_ROWS_DEQUANTIZED)  # [M, N]
    else:
        out = torch.ops.aten._weight_int8pack_mm(x2, weight, scales)  # [M, N]
    if zero_terms is not None:
        # Summed in fp32: sum(x) over thousands of channels loses digits in bf16.
        correction = x2.float().sum(dim=-1, keepdim=True) * zero_terms.float()  # [M, N]
        out = (out.float() - correction).to(x.dtype)
    if bias is not None and fused_bias is None:
        out = out + bias
    return out.reshape(*x.shape[:-1], pair_layout.output_features(weight))


_lib.impl("int4pack_linear", int4pack_linear, "CompositeImplicitAutograd")
_lib.impl("int8pack_linear", int8pack_linear, "CompositeImplicitAutograd")



class Int4PackLayout(Layout):
    """4-bit codes in qrt's pack (or ATen's) with a scale and an offset per group of `cpu_group`."""

    name = "int4pack"

    def pack(self, weights: IntWeights, dtype: torch.dtype) -> Packed:
        w = weights
        k, n = w.q.shape
        cpu_group = int4_cpu_group(k, n, w.group_size)
        packed, scale_offsets = pack_int4_for_cpu(w.q, w.scales, w.zeros, w.group_size, cpu_group, dtype)
        codes = ("qrt int4 codes [N/64, K/2, 64], scale+offset [N/64, K/g, 64, 2]" if int4_pairs_cpu.is_packed(packed)
                 else "ATen int4 CPU pack [N, K/2], scale+offset [K/g, N, 2]")
        # packed: uint8 [N, K / 2] (ATen's) or [N / 64, K / 2, 64] (qrt's); scale_offsets in the
        # model dtype, [K / g, N, 2] or [N / 64, K / g, 64, 2]
        return Packed({"weight": packed, "scale_offsets": scale_offsets}, storage=f"{codes}, g{cpu_group}",
                      constants={"cpu_group": cpu_group})

    def linear(self, layer, x, bits: int, group_size: int):
        return torch.ops.qrt.int4pack_linear(x, layer.weight, layer.scale_offsets, layer.perm, layer.bias,
                                             layer.cpu_group)


class Int8PackLayout(Layout):
    """int8 codes [N, K] (or in pairs) with one scale per output channel, and a zero-point
    correction where a channel is asymmetric."""

    name = "int8pack"

    def pack(self, weights: IntWeights, dtype: torch.dtype) -> Packed:
        weight, scales, zero_terms = pack_int8_for_cpu(weights.q, weights.scales, weights.zeros, dtype)
        asym = "" if zero_terms is None else ", zero-point correction"
        codes = "int8 pairs [N/64, K/2, 64, 2]" if pair_layout.is_pair_packed(weight) else "int8 [N, K]"
        # weight: int8 [N, K] or in pairs; scales, zero_terms: [N] in the model dtype
        return Packed({"weight": weight, "scales": scales, "zero_terms": zero_terms},
                      storage=f"{codes}, channel scales{asym}")

    def linear(self, layer, x, bits: int, group_size: int):
        return torch.ops.qrt.int8pack_linear(x, layer.weight, layer.scales, layer.zero_terms, layer.bias)


declare(Kernel(
    "qrt.int4pack_linear", devices=("cpu",), serves=("qrt.int_linear",), layout=Int4PackLayout(),
    accepts=lambda bits, group_size, k, n, contiguous_groups: (
        contiguous_groups and bits == 4 and int4_cpu_group(k, n, group_size) is not None),
    why="CPU: the loader pass packed the 4-bit weights for ATen's int4 matmul"))
declare(Kernel(
    "qrt.int8pack_linear", devices=("cpu",), serves=("qrt.int_linear",), layout=Int8PackLayout(),
    # ATen's int8 kernel takes one scale per channel, and is wrong for K not a multiple of 16.
    accepts=lambda bits, group_size, k, n, contiguous_groups: (
        contiguous_groups and bits == 8 and group_size >= k and k % 16 == 0),
    why="CPU: the loader pass stored int8 weights for ATen's int8 matmul"))
