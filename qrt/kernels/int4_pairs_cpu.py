"""qrt's CPU kernel for 4-bit weight-only linears in groups along K: `qrt_cpu::int4_pairs_linear`
(csrc/int4_pairs_cpu.cpp) on codes packed for it, uint8 [N / 64, K / 2, 64].

It is the `int4pack` layout's kernel wherever it can run (bf16 activations, N a multiple of 64,
an even group size, qrt's library built): `pack_int4_for_cpu` (int_cpu.py) packs the codes and
their group scales this way and `qrt::int4pack_linear` calls this op on them, at every M. Against
ATen's CPU pack and its kernels (qrt's GEMV at one row, ATen's below 64 rows, dequantized tiles and
oneDNN above), the codes widen to bf16 pairs in fewer instructions, a block's group scales lie
together, and one op serves any number of rows (bench/probes/cpu_native_options.py).

The layout: block b holds outputs 64 b .. 64 b + 63; its step j is 32 little-endian 16-bit words,
word 2 i + t holding q[64 b + 16 c + i, 2 j + t] in nibble c (c = 0 .. 3, the low nibble first).
scale_offsets: bf16 [N / 64, K / g, 64, 2], the (scale, offset) of output 64 b + d in group h at
(b, h, d). W = (q - 8) * scale + offset, as ATen's int4 kernel defines it.

Numerics: below `MIN_ROWS_DEQUANTIZED` rows (decode steps, small batches) each row sums the exact
products of the codes with x in fp32 per group, then applies the group's scale and offset (no
rounding of W), in the same order at any M there, so a row's result does not depend on its batch.
From there (prompts) W is rounded to bf16 once, a tile of outputs at a time, for oneDNN's GEMM.
"""

import torch

from . import native_cpu

OUTPUTS_PER_BLOCK = 64
STEP_BYTES = 64  # 64 outputs x 2 columns x 4 bits
# The exact route's cost grows with M (it is compute-bound past a few rows), the dequantized route's
# barely: at 32 rows the dequantized one is faster on every shape of bench/probes/cpu_native_options.py,
# at 16 on about half of them.
MIN_ROWS_DEQUANTIZED = 32


def packable(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether a [N, K] 4-bit weight in groups of `group_size` for a model in `dtype` can run here."""
    return (dtype == torch.bfloat16 and n % OUTPUTS_PER_BLOCK == 0 and group_size % 2 == 0
            and k % group_size == 0 and native_cpu.available())


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes q [K, N] (integers in [0, 16)) -> uint8 [N / 64, K / 2, 64] (the layout above)."""
    k, n = q.shape
    parts = q.to(torch.uint8).view(k // 2, 2, n // OUTPUTS_PER_BLOCK, 4, 16)  # [j, t, b, c, i]
    # The little-endian 16-bit word c0 | c1 << 4 | c2 << 8 | c3 << 12 of (j, t, b, i), built a byte
    # at a time: bytes move a quarter of the memory that int32 temporaries would.
    low = parts[:, :, :, 0] | parts[:, :, :, 1] << 4  # [j, t, b, i]
    high = parts[:, :, :, 2] | parts[:, :, :, 3] << 4
    words = torch.stack([low, high], dim=-1).permute(2, 0, 3, 1, 4)  # [b, j, i, t, byte]
    return words.contiguous().view(n // OUTPUTS_PER_BLOCK, k // 2, STEP_BYTES)


def pack_scale_offsets(scale_offsets: torch.Tensor) -> torch.Tensor:
    """[K / g, N, 2] -> [N / 64, K / g, 64, 2]: each block's groups together."""
    groups, n, _ = scale_offsets.shape
    return scale_offsets.view(groups, n // OUTPUTS_PER_BLOCK, OUTPUTS_PER_BLOCK, 2).permute(1, 0, 2, 3).contiguous()


def is_packed(packed: torch.Tensor) -> bool:
    """True for codes in this layout (a static property of their shape: ATen's pack is 2-D)."""
    return packed.dim() == 3 and packed.shape[2] == STEP_BYTES


def output_features(packed: torch.Tensor) -> int:
    return packed.shape[0] * OUTPUTS_PER_BLOCK
