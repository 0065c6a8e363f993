"""The GGML block types qrt runs as stored, each decoded exactly into the neutral integer form
(`IntWeights`) that every integer kernel packs from. Blocks run along K; a tensor's blocks arrive as
uint8 [N, K / weights per block, bytes per block].

| type | block (bytes) | weight | as IntWeights |
|---|---|---|---|
| Q4_0 | 32: d fp16, 16 bytes of 4-bit codes (18) | d · (q − 8) | 4-bit, g32, scale d, zero 8 |
| Q4_1 | 32: d, m fp16, 16 bytes of 4-bit codes (20) | d · q + m | 4-bit, g32, scale d, zero −m / d |
| Q5_0 | 32: d fp16, 4 bytes of fifth bits, 16 bytes of 4-bit codes (22) | d · (q − 16) | 8-bit (codes < 32), g32, scale d, zero 16 |
| Q5_1 | 32: d, m fp16, fifth bits, 4-bit codes (24) | d · q + m | 8-bit (codes < 32), g32, scale d, zero −m / d |
| Q8_0 | 32: d fp16, 32 int8 codes (34) | d · q | 8-bit, g32, q + 128, scale d, zero 128 |
| Q4_K | 256: d, dmin fp16, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes (144) | d·sc · q − dmin·m per 32 | 4-bit, g32, scale d·sc, zero dmin·m / (d·sc) |
| Q5_K | 256: as Q4_K, plus 32 bytes of fifth bits (176) | d·sc · q − dmin·m per 32 | 8-bit (codes < 32), g32, as Q4_K |
| Q6_K | 256: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d fp16 (210) | d·sc · (q − 32) per 16 | 8-bit (codes < 64), g16, scale d·sc, zero 32 |

The byte orders are ggml's (`block_q4_0` … `block_q6_K` in ggml-common.h); gguf-py's dequantizer,
which reads the same bytes, is what the tests hold these decoders to. A group whose scale is 0
but whose offset is not (a Q4_1 block with d = 0, a Q4_K/Q5_K sub-block with sc = 0) is that
offset throughout: its codes become 1 with the offset as the scale and zero 0, the same weights.

On the CPU every type but Q8_0 runs at its own width on the kernel of `SuperblockWeights`
(`superblock_weights`): the codes at 4, 5 or 6 bits with the file's group scales and fp16
super-block scales. Elsewhere the 5- and 6-bit codes are held in bytes, as 8-bit codes whose values
stay below 32 or 64 (`decode_blocks`), so every 8-bit integer kernel runs them.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from qrt.kernels.int_reference import IntWeights
from qrt.kernels.superblock_reference import SuperblockWeights


@dataclass
class BlockFields:
    """A grid of blocks' fields as stored, uint8 grid [N, B, bytes] -> (shapes below); weight =
    d · sc · (q − zero) + dmin · m per group (superblock_reference.py: sc absent is 1, m absent is 1,
    dmin absent is no offset)."""

    codes: torch.Tensor  # uint8 [N, B, weights per block]
    d: torch.Tensor  # fp16 [N, B, 1]
    sc: torch.Tensor | None = None  # int8 [N, B, groups per block]
    dmin: torch.Tensor | None = None  # fp16 [N, B, 1]
    m: torch.Tensor | None = None  # int8 [N, B, groups per block]


@dataclass(frozen=True)
class BlockType:
    name: str
    weights: int  # weights per block along K
    bytes: int  # bytes per block
    code_bits: int  # width of the codes in the file
    bits: int  # width of the IntWeights codes (8 for the 5- and 6-bit codes, held in bytes)
    group_size: int  # weights per scale
    zero: int  # subtracted from every code
    fields: Callable[[torch.Tensor], BlockFields]


def _fp16(grid: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block: grid uint8 [N, B, bytes] -> fp16 [N, B, 1]."""
    return grid[..., at:at + 2].contiguous().view(torch.float16)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., R, 32] -> codes [..., 2 R, 32]: each run of 32 bytes holds one group of 32 in its
    low nibbles and the next group in its high ones."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-2).flatten(-3, -2)


def _q4_0(grid):
    q = torch.cat([grid[..., 2:] & 0xF, grid[..., 2:] >> 4], dim=-1)  # [N, B, 32]: low nibbles first
    return BlockFields(q, _fp16(grid, 0))


def _q4_1(grid):
    q = torch.cat([grid[..., 4:] & 0xF, grid[..., 4:] >> 4], dim=-1)  # [N, B, 32]
    return BlockFields(q, _fp16(grid, 0), dmin=_fp16(grid, 2))


def _fifth_bits(grid: torch.Tensor, at: int) -> torch.Tensor:
    """Bit j of the little-endian 32-bit word at byte `at` of every block, for j = 0..31: the fifth
    bit of element j of a Q5_0/Q5_1 block. grid [N, B, bytes] -> uint8 [N, B, 32]."""
    word = grid[..., at:at + 4].unsqueeze(-1)  # [N, B, 4 bytes, 1]
    bits = (word >> torch.arange(8, dtype=torch.uint8)) & 1  # [N, B, 4, 8]: byte b's bit i is bit 8 b + i
    return bits.flatten(-2)


def _q5_0(grid):
    q = torch.cat([grid[..., 6:] & 0xF, grid[..., 6:] >> 4], dim=-1) | (_fifth_bits(grid, 2) << 4)  # [N, B, 32]
    return BlockFields(q, _fp16(grid, 0))


def _q5_1(grid):
    q = torch.cat([grid[..., 8:] & 0xF, grid[..., 8:] >> 4], dim=-1) | (_fifth_bits(grid, 4) << 4)  # [N, B, 32]
    return BlockFields(q, _fp16(grid, 0), dmin=_fp16(grid, 2))


def _q8_0(grid):
    q = grid[..., 2:] ^ 0x80  # [N, B, 32] uint8: the int8 code + 128 is its byte with the top bit flipped
    return BlockFields(q, _fp16(grid, 0))


def _k_scales(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of a Q4_K/Q5_K block's 8 groups, from its 12 bytes at 4..15:
    bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes
    0-3 and 4-7. Returns int8 [N, B, 8] each (values < 64)."""
    packed = grid[..., 4:16].reshape(*grid.shape[:-1], 3, 4)  # [N, B, 3, 4]
    lows, mins, highs = packed.unbind(-2)
    scales = torch.cat([lows & 0x3F, (highs & 0xF) | ((lows >> 2) & 0x30)], dim=-1)
    minimums = torch.cat([mins & 0x3F, (highs >> 4) | ((mins >> 2) & 0x30)], dim=-1)
    return scales.view(torch.int8), minimums.view(torch.int8)


def _q4_k(grid):
    sc, m = _k_scales(grid)
    q = _nibbles(grid[..., 16:].reshape(*grid.shape[:-1], 4, 32)).flatten(-2)  # [N, B, 256]
    return BlockFields(q, _fp16(grid, 0), sc, -_fp16(grid, 2), m)  # weight d·sc·q − dmin·m: dmin negated, exactly


def _q5_k(grid):
    sc, m = _k_scales(grid)
    low = _nibbles(grid[..., 48:].reshape(*grid.shape[:-1], 4, 32))  # [N, B, 8, 32]
    high_bits = grid[..., 16:48].unsqueeze(-2)  # [N, B, 1, 32]: bit g of byte l is weight l of group g's
    shifts = torch.arange(8, dtype=torch.uint8)
    high = (high_bits >> shifts[:, None]) & 1  # [N, B, 8, 32]
    q = (low | (high << 4)).flatten(-2)  # [N, B, 256], values < 32
    return BlockFields(q, _fp16(grid, 0), sc, -_fp16(grid, 2), m)


def _q6_k(grid):
    lead = grid.shape[:-1]
    # Low nibbles: two halves of 128 weights, each 64 bytes whose low nibbles are weights 0-63 of
    # the half and high nibbles 64-127. High pairs: 32 bytes a half, bits 2t..2t+1 of byte l
    # completing weight 32 t + l of the half.
    halves = grid[..., :128].reshape(*lead, 2, 2, 32)  # [N, B, half, 32-byte run, 32]
    low = torch.stack([halves & 0xF, halves >> 4], dim=-3).flatten(-3, -2)  # [N, B, 2, 4 (nibble, run), 32]
    pairs = grid[..., 128:192].reshape(*lead, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    high = (pairs >> shifts[:, None]) & 3  # [N, B, 2, 4, 32]
    q = (low | (high << 4)).flatten(-3)  # [N, B, 256], values < 64
    return BlockFields(q, _fp16(grid, 208), grid[..., 192:208].contiguous().view(torch.int8))


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 32, 18, 4, 4, 32, 8, _q4_0),
    BlockType("Q4_1", 32, 20, 4, 4, 32, 0, _q4_1),
    BlockType("Q5_0", 32, 22, 5, 8, 32, 16, _q5_0),
    BlockType("Q5_1", 32, 24, 5, 8, 32, 0, _q5_1),
    BlockType("Q8_0", 32, 34, 8, 8, 32, 128, _q8_0),
    BlockType("Q4_K", 256, 144, 4, 4, 32, 0, _q4_k),
    BlockType("Q5_K", 256, 176, 5, 8, 32, 0, _q5_k),
    BlockType("Q6_K", 256, 210, 6, 8, 16, 32, _q6_k),
)}


def _grid(blocks: torch.Tensor, kind: BlockType, k: int) -> torch.Tensor:
    """uint8 [N, K / weights, bytes] (or [N, K / weights · bytes], as gguf-py writes them) -> [N, B, bytes]."""
    return blocks.reshape(blocks.shape[0], k // kind.weights, kind.bytes)


def superblock_weights(blocks: torch.Tensor, ggml_type: str, k: int) -> SuperblockWeights:
    """A tensor's blocks as the fields they store (q [N, K]), for kernels that read codes at their
    own width with the file's two levels of scales."""
    kind = BLOCK_TYPES[ggml_type]
    fields = kind.fields(_grid(blocks, kind, k))
    n = blocks.shape[0]

    def flat(t):
        return None if t is None else t.reshape(n, -1)

    return SuperblockWeights(fields.codes.reshape(n, k), kind.code_bits, kind.zero, kind.group_size,
                             flat(fields.d), flat(fields.sc), flat(fields.dmin), flat(fields.m))


# Rows are decoded a slice at a time into the transposed codes: decoding a whole tensor at once
# held its codes twice more ([N, K], then the transpose), the load's peak on a large output layer.
ROWS_PER_SLICE = 4096


def decode_blocks(blocks: torch.Tensor, ggml_type: str, k: int) -> IntWeights:
    """A tensor's blocks, uint8 [N, K / weights, bytes] (or [N, K / weights · bytes], as gguf-py
    writes them), as IntWeights (q [K, N]): scale d · sc per group, zero point from the type's zero
    or from its offset dmin · m."""
    kind = BLOCK_TYPES[ggml_type]
    n = blocks.shape[0]
    groups = k // kind.group_size
    grid = _grid(blocks, kind, k)  # [N, B, bytes]
    q = torch.empty(k, n, dtype=torch.uint8)  # [K, N]
    scales = torch.empty(n, groups)  # [N, K / g] fp32
    offsets = torch.empty(n, groups)
    for start in range(0, n, ROWS_PER_SLICE):
        rows = slice(start, min(start + ROWS_PER_SLICE, n))
        part = superblock_weights(grid[rows], ggml_type, k)
        slice_scales, slice_offsets = part.group_factors()  # [n, K / g]
        q[:, rows] = part.q.t()
        scales[rows] = slice_scales
        offsets[rows] = -kind.zero * slice_scales if slice_offsets is None else slice_offsets
    # scale · q + offset = scale · (q − zero) with zero = −offset / scale; a group of scale 0 is its
    # offset throughout: codes 1, scale offset, zero 0.
    flat = scales == 0  # [N, K / g]
    if bool(flat.any()):  # rare: spare the common case passes over the codes
        by_group = (flat & (offsets != 0)).repeat_interleave(kind.group_size, dim=1)  # [N, K]
        q.masked_fill_(by_group.t(), 1)
    zeros = torch.where(flat, torch.zeros_like(scales), -offsets / torch.where(flat, torch.ones_like(scales), scales))
    scales = torch.where(flat, offsets, scales)
    return IntWeights(q, scales.t().contiguous(), zeros.t().contiguous(), kind.bits, kind.group_size)
