"""qrt's CPU kernel for codes of 4, 5 or 6 bits with two levels of scales (`SuperblockWeights`,
superblock_reference.py): `qrt::superblock_linear`, on `qrt_cpu::superblock_linear`
(csrc/superblock_cpu.cpp). llama.cpp's block types (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) run
on it at their own width: the codes at 4, 5 or 6 bits, the file's integer group scales and mins a
byte each, its fp16 super-block scales as they are. A Q6_K weight takes 6.5625 bits, as in the
file; a Q4_K one 4.625 (the file's 4.5, its 6-bit scales and mins held a byte each).

The codes, [N / 64, K / 2, step]: block b holds outputs 64 b .. 64 b + 63; its step j starts with
the low nibbles of 128 codes in the layout of int4_pairs_cpu.py (word w = 2 i + t of 32
little-endian 16-bit words holds the code of output 16 c + i at column 2 j + t in nibble c), and
goes on with their high bits: for 6 bits 32 bytes, byte w holding bits 4-5 of word w's code c at
bits 2 c and 2 c + 1; for 5 bits 16 bytes, byte p holding bit 4 of word p's code c at bit c and of
word p + 16's at bit 4 + c. Scales lie per block, [N / 64, groups, 64], so each block's are
read front to back with its codes.

A layer may hold several parts along N, each at its own width and scales: a fused q/k/v layer of
llama.cpp's mixes keeps v in Q6_K beside q and k in Q4_K. Each part runs as its own call, and the
outputs are concatenated.

Numerics: below `MIN_ROWS_DEQUANTIZED` rows, exact products of the codes with x summed in fp32 per
group, then d · sc · (sum − (128 + zero) · sum(x)) + dmin · m · sum(x), in the same order at any M
there (a row's result does not depend on its batch); from there W rounded to bf16 once, a tile at a
time, for oneDNN's GEMM. bf16 models only: the products are bf16 pairs.
"""

from dataclasses import dataclass

import torch

from . import int4_pairs_cpu, native_cpu
from .choices import Kernel, declare
from .layouts import Layout, Packed
from .superblock_reference import SuperblockWeights

OUTPUTS_PER_BLOCK = 64
# The exact route's cost grows with M, the dequantized one's barely; the 4-bit kernel on the same
# loop crosses over between 16 and 32 rows (int4_pairs_cpu.py).
MIN_ROWS_DEQUANTIZED = 32
SCALE_TENSORS = ("sub_scales", "sub_offsets", "super_scales", "super_offsets")

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("superblock_linear(Tensor x, Tensor codes, Tensor? sub_scales, Tensor? sub_offsets, Tensor super_scales, "
            "Tensor? super_offsets, Tensor? bias, int bits, int zero, int group_size) -> Tensor")


def packable(w: SuperblockWeights, dtype: torch.dtype) -> bool:
    n, k = w.q.shape
    return (dtype == torch.bfloat16 and w.bits in (4, 5, 6) and n % OUTPUTS_PER_BLOCK == 0
            and w.group_size % 2 == 0 and k % w.super_size == 0 and native_cpu.available())


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q [N, K] -> uint8 [N / 64, K / 2, 64 + 16 (bits - 4)] (the layout above)."""
    n, k = q.shape
    codes = q.t().contiguous()  # [K, N]
    nibbles = int4_pairs_cpu.pack_codes(codes & 0xF)  # [N / 64, K / 2, 64]
    if bits == 4:
        return nibbles
    high = (codes >> 4).view(k // 2, 2, n // OUTPUTS_PER_BLOCK, 4, 16)  # [j, t, b, c, i]
    width = bits - 4  # high bits per code
    shifts = torch.arange(4, dtype=torch.uint8) * width  # code c's place in its word's byte of high bits
    per_word = (high << shifts[:, None]).sum(dim=3, dtype=torch.uint8)  # [j, t, b, i]: word 2 i + t's bits
    words = per_word.permute(2, 0, 3, 1).reshape(n // OUTPUTS_PER_BLOCK, k // 2, 32)  # [b, j, w]
    if bits == 5:  # two words a byte: word p in the low nibble, word p + 16 in the high one
        words = words[..., :16] | (words[..., 16:] << 4)
    return torch.cat([nibbles, words], dim=-1)


def block_major(values: torch.Tensor | None) -> torch.Tensor | None:
    """Per-output values [N, C] -> [N / 64, C, 64]: each block's together, in order along K."""
    if values is None:
        return None
    n, count = values.shape
    return values.view(n // OUTPUTS_PER_BLOCK, OUTPUTS_PER_BLOCK, count).permute(0, 2, 1).contiguous()


def row_codes(codes: torch.Tensor, lane: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of output `lane[r]` of block `codes[r]`: codes uint8 [R, K / 2, step], lane [R] ->
    q [R, K]. Output 16 c + i's code at column 2 j + t is nibble c of word 2 i + t of step j."""
    rows, half_k, _ = codes.shape
    c, i = lane // 16, lane % 16  # [R]
    t = torch.arange(2)  # [2]
    word = 2 * i[:, None] + t  # [R, 2]
    low_byte = codes.gather(2, (2 * word + c[:, None] // 2)[:, None, :].expand(-1, half_k, -1))  # [R, K / 2, 2]
    q = (low_byte >> (4 * (c % 2)).to(torch.uint8).view(-1, 1, 1)) & 0xF
    if bits == 6:  # bits 2 c, 2 c + 1 of byte w
        high = codes.gather(2, (64 + word)[:, None, :].expand(-1, half_k, -1)) >> (2 * c).to(torch.uint8).view(-1, 1, 1)
        q = q | ((high & 3) << 4)
    elif bits == 5:  # bit c (word < 16) or 4 + c (word >= 16) of byte w % 16
        high = codes.gather(2, (64 + word % 16)[:, None, :].expand(-1, half_k, -1))
        q = q | (((high >> (c[:, None] + 4 * (word // 16)).to(torch.uint8)[:, None, :]) & 1) << 4)
    return q.reshape(rows, 2 * half_k)


def pack_part(w: SuperblockWeights) -> dict:
    """One part's tensors for the kernel."""
    return {"codes": pack_codes(w.q, w.bits), "sub_scales": block_major(w.sub_scales),
            "sub_offsets": block_major(w.sub_offsets), "super_scales": block_major(w.super_scales),
            "super_offsets": block_major(w.super_offsets)}


def superblock_linear(x, codes, sub_scales, sub_offsets, super_scales, super_offsets, bias, bits: int, zero: int,
                      group_size: int):
    """x: [..., K] bf16; codes: uint8 [N / 64, K / 2, step]. Returns [..., N]."""
    k = x.shape[-1]
    out = torch.ops.qrt_cpu.superblock_linear(x.reshape(-1, k), codes, bits, zero, sub_scales, sub_offsets,
                                              super_scales, super_offsets, group_size, bias,
                                              MIN_ROWS_DEQUANTIZED)  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])


# CompositeImplicitAutograd: a compiled graph sees the kernel call itself.
_lib.impl("superblock_linear", superblock_linear, "CompositeImplicitAutograd")


@dataclass(frozen=True)
class PartSpec:
    """What `linear` needs of one part beyond its tensors."""

    outputs: int
    bits: int
    zero: int
    group_size: int


def part_names(index: int) -> dict[str, str]:
    """Parameter names of part `index`'s tensors: the first part's codes are the layer's `weight`."""
    prefix = "" if index == 0 else f"part{index}_"
    names = {name: f"{prefix}{name}" for name in SCALE_TENSORS}
    names["codes"] = "weight" if index == 0 else f"part{index}_weight"
    return names


class SuperblockLayout(Layout):
    """Codes at their own width with their group and super-block scales, in one or more parts along N."""

    name = "superblock"

    def pack(self, weights: list[SuperblockWeights], dtype: torch.dtype) -> Packed:
        tensors, specs, described = {}, [], []
        for index, part in enumerate(weights):
            names = part_names(index)
            for key, tensor in pack_part(part).items():
                tensors[names[key]] = tensor
            specs.append(PartSpec(part.q.shape[0], part.bits, part.zero, part.group_size))
            described.append(f"{part.bits}-bit g{part.group_size}/{part.super_size}")
        # codes uint8 [N / 64, K / 2, 64 + 16 (bits - 4)], scales [N / 64, K / G or K / S, 64] per part
        return Packed(tensors, storage=f"codes at their width + int8 group scales + fp16 super-block scales, "
                                       f"[N/64, K/2, step]: {', '.join(described)}",
                      constants={"superblock_parts": tuple(specs)},
                      kernel_tensors=tuple(part_names(i)["codes"] for i in range(len(weights))))

    def linear(self, layer, x, *settings):
        outputs, start = [], 0
        for index, spec in enumerate(layer.superblock_parts):
            names = part_names(index)
            bias = None if layer.bias is None else layer.bias.narrow(0, start, spec.outputs)
            outputs.append(torch.ops.qrt.superblock_linear(
                x, getattr(layer, names["codes"]), *(getattr(layer, names[t]) for t in SCALE_TENSORS), bias,
                spec.bits, spec.zero, spec.group_size))
            start += spec.outputs
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    gathers_rows = True

    def rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a one-part weight, dequantized as the reference does, in the model dtype."""
        if len(layer.superblock_parts) != 1:
            raise NotImplementedError("superblock rows of a weight in several parts")
        spec = layer.superblock_parts[0]
        flat = ids.reshape(-1)  # [R]
        block, lane = flat // OUTPUTS_PER_BLOCK, flat % OUTPUTS_PER_BLOCK

        def lane_of(tensor):  # [N / 64, C, 64] -> the rows' [R, C]
            if tensor is None:
                return None
            picked = tensor[block]  # [R, C, 64]
            return picked.gather(2, lane.view(-1, 1, 1).expand(-1, picked.shape[1], 1)).squeeze(2)

        q = row_codes(layer.weight[block], lane, spec.bits)  # [R, K]
        weights = SuperblockWeights(q, spec.bits, spec.zero, spec.group_size, lane_of(layer.super_scales),
                                    lane_of(layer.sub_scales), lane_of(layer.super_offsets), lane_of(layer.sub_offsets))
        return weights.dequantize().reshape(*ids.shape, -1).to(layer.params_dtype)


declare(Kernel(
    "qrt.superblock_linear", devices=("cpu",), serves=("qrt.superblock_linear",), layout=SuperblockLayout(),
    accepts=lambda parts, dtype: all(packable(part, dtype) for part in parts),
    why="CPU: codes at their own width (4, 5 or 6 bits) with their group and super-block scales, decoded in "
        "registers by qrt's AVX-512 kernel"))
