"""The pair layout of qrt's CPU GEMV kernels (csrc/pair_gemv.h): a weight W [N, K] stored as
[N / 64, K / 2, 64, 2], block b of 64 outputs and step j holding the pairs (W[n, 2j], W[n, 2j + 1])
of its outputs. bf16 and int8 keep the outputs of a step in order; e4m3 codes put them in the
order their widening's byte unpack produces (`pack_in_unpack_order`).

Shared by bf16_native_cpu.py, int8_pairs_cpu.py and fp8_pairs_cpu.py. Whether a weight is packed
is a property of its shape, so in a traced graph it is decided once, at trace time."""

import torch

from . import native_cpu

OUTPUTS_PER_BLOCK = 64  # output rows per packed block


def packable(weight: torch.Tensor, dtype: torch.dtype, model_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `weight` [N, K] of `dtype` (N whole blocks, K even, on the CPU) can be packed for a
    model in `model_dtype`: the kernels take bf16 activations only, and need qrt's library built."""
    return (weight.dim() == 2 and weight.dtype == dtype and weight.device.type == "cpu"
            and model_dtype == torch.bfloat16 and weight.shape[0] % OUTPUTS_PER_BLOCK == 0
            and weight.shape[1] % 2 == 0 and native_cpu.available())


def pack_in_order(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 64, K / 2, 64, 2], element (b, j, d, t) = weight[64 b + d, 2 j + t]."""
    n, k = weight.shape
    blocks = weight.detach().reshape(n // OUTPUTS_PER_BLOCK, OUTPUTS_PER_BLOCK, k // 2, 2)  # [b, d, j, t]
    return blocks.permute(0, 2, 1, 3).contiguous()


def pack_in_unpack_order(codes: torch.Tensor) -> torch.Tensor:
    """Byte codes [N, K] -> [N / 64, K / 2, 64, 2], each step's pairs in the order of the byte unpack
    (`widen_fp8x64` in csrc/fp8_codes.h): with d = 32 h + 16 u + 4 L + r (half h, unpack half u,
    128-bit lane L, r < 4), the pair of output d is entry 32 h + 8 L + 4 u + r of the step's 64."""
    n, k = codes.shape
    blocks = n // OUTPUTS_PER_BLOCK
    by_part = codes.detach().contiguous().reshape(blocks, 2, 2, 4, 4, k // 2, 2)  # [b, h, u, L, r, j, t]
    return by_part.permute(0, 5, 1, 3, 2, 4, 6).reshape(blocks, k // 2, OUTPUTS_PER_BLOCK, 2).contiguous()


def unpack_from_unpack_order(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_in_unpack_order`."""
    blocks, half_k = packed.shape[:2]
    by_part = packed.reshape(blocks, half_k, 2, 4, 2, 4, 2)  # [b, j, h, L, u, r, t]
    return by_part.permute(0, 2, 4, 3, 5, 1, 6).reshape(blocks * OUTPUTS_PER_BLOCK, 2 * half_k).contiguous()


def is_pair_packed(weight: torch.Tensor) -> bool:
    """True for a weight in the pair layout (a static property of its shape)."""
    return weight.dim() == 4 and weight.shape[2] == OUTPUTS_PER_BLOCK and weight.shape[3] == 2


def output_features(weight: torch.Tensor) -> int:
    """N of a weight in the pair layout or in [N, K]."""
    return weight.shape[0] * OUTPUTS_PER_BLOCK if is_pair_packed(weight) else weight.shape[0]
