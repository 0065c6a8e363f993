"""qrt's CPU kernel for fp8 linears with per-channel (or per-tensor) weight scales:
`qrt_cpu::fp8_pairs_linear` (csrc/fp8_pairs_cpu.cpp) on the e4m3 codes packed in pairs,
[N, K] -> [N / 64, K / 2, 64, 2], the layout of the dense bf16 kernel (csrc/pair_gemv.h) with the
pairs of each step in the order the kernel's byte unpack produces them.

The activations are quantized to e4m3 inside the op exactly as the reference does (per token, or
with a static scale); the codes are widened by table lookup in registers, and both scales
multiply each output's fp32 sum once. Against `qrt_cpu::fp8_linear`'s GEMV on [N, K] codes, the
outputs lie across the vector lanes (no horizontal sums) and the activations need no reordered,
zero-padded copy (bench/cpu_native_options.py).

Like the bf16 pairs, this layout is made by the loader step for compiled CPU models
(loaders/prepack.py), after the loader pass chose `qrt.fp8_linear_native_cpu` or its static
variant: eager models keep [N, K] codes, so eager mode stays the reference. A layer whose weight
is packed calls `linear` below instead of its logical op.

Numerics: as the [N, K] GEMV (exact products summed in fp32, one bf16 rounding), in another fixed
order per output; a row's result does not depend on the other rows of its batch.
"""

import torch

from . import native_cpu
from .choices import Kernel, declare

OUTPUTS_PER_BLOCK = 64  # output rows per packed block (csrc/pair_gemv.h)


def packable(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether e4m3 codes [N, K] of a model in `dtype` can run on this kernel here."""
    return (weight.dim() == 2 and weight.dtype == torch.float8_e4m3fn and weight.device.type == "cpu"
            and dtype == torch.bfloat16 and weight.shape[0] % OUTPUTS_PER_BLOCK == 0 and weight.shape[1] % 2 == 0
            and native_cpu.available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] -> [N / 64, K / 2, 64, 2]: block b, step j holds the pairs (w[n, 2j], w[n, 2j + 1])
    of outputs n = 64 b + d in the order of the kernel's byte unpack. With d = 32 h + 16 u + 4 L + r
    (half h, unpack half u, 128-bit lane L, r < 4), the pair of d is entry 32 h + 8 L + 4 u + r of
    the step's 64."""
    n, k = weight.shape
    blocks = n // OUTPUTS_PER_BLOCK
    codes = weight.detach().contiguous().view(torch.uint8)  # permuted as bytes
    by_part = codes.reshape(blocks, 2, 2, 4, 4, k // 2, 2)  # [b, h, u, L, r, j, t]
    packed = by_part.permute(0, 5, 1, 3, 2, 4, 6).reshape(blocks, k // 2, OUTPUTS_PER_BLOCK, 2).contiguous()
    return packed.view(torch.float8_e4m3fn)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_weight`: [N / 64, K / 2, 64, 2] -> e4m3 [N, K]."""
    blocks, half_k = packed.shape[:2]
    by_part = packed.view(torch.uint8).reshape(blocks, half_k, 2, 4, 2, 4, 2)  # [b, j, h, L, u, r, t]
    codes = by_part.permute(0, 2, 4, 3, 5, 1, 6).reshape(blocks * OUTPUTS_PER_BLOCK, 2 * half_k)
    return codes.contiguous().view(torch.float8_e4m3fn)


def is_pair_packed(weight: torch.Tensor) -> bool:
    """True for codes made by `pack_weight` (a static property of the shape: decided at trace time)."""
    return weight.dim() == 4 and weight.shape[2] == OUTPUTS_PER_BLOCK and weight.shape[3] == 2


def linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] bf16; packed: [N / 64, K / 2, 64, 2] e4m3; weight_scale: fp32 [N] -> [..., N]."""
    out = torch.ops.qrt_cpu.fp8_pairs_linear(x.reshape(-1, x.shape[-1]), packed, weight_scale, bias,
                                             input_scale)  # [M, N]
    return out.reshape(*x.shape[:-1], packed.shape[0] * OUTPUTS_PER_BLOCK)


# Not chosen by a loader pass: prepack_cpu_weights (loaders/prepack.py) packs the codes of layers
# whose kernel is qrt's fp8 GEMV (per channel or per tensor, dynamic or static activations).
declare(Kernel(
    "qrt_cpu.fp8_pairs_linear", devices=("cpu",), serves=(), layout="fp8 pairs",
    why="CPU: qrt's AVX-512 kernel on the e4m3 codes packed in pairs, called from the compiled graph"))
