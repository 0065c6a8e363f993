"""qrt's CPU kernel for 4-bit codes looked up in a 16-entry table times block scales
(`Lut4Weights`, lut4_reference.py): `qrt::lut4_pairs_linear`, on `qrt_cpu::lut4_linear`
(csrc/lut4_cpu.cpp). bitsandbytes NF4/FP4, NVFP4 and MXFP4 weights run on it at their own width:
the codes at 4 bits in the layout of int4_pairs_cpu.py, the block scales as the checkpoint stores
them (fp32, e4m3 or e8m0), a block's together ([N / 64, K / G, 64]).

Numerics: the table's values are rounded to bf16 once (exact for E2M1; NF4's values move by at
most 2^-9 of their size). Below `MIN_ROWS_DEQUANTIZED` rows, exact products of those values with x
summed in fp32 per group, then times the group's scale, in the same order at any M there (a row's
result does not depend on its batch); from there W = table[q] · scale rounded to bf16 once, a tile
at a time, for oneDNN's GEMM. bf16 models only: the products are bf16 pairs.
"""

import torch

from . import int4_pairs_cpu, native_cpu
from .choices import Kernel, declare
from .layouts import Layout, Packed
from .lut4_reference import SCALE_FORMATS, Lut4Weights, bits_per_weight
from .superblock_cpu import block_major

OUTPUTS_PER_BLOCK = 64
# As for the 4-bit integer kernel on the same loop (int4_pairs_cpu.py): from 32 rows the
# dequantized tile and oneDNN's GEMM are faster.
MIN_ROWS_DEQUANTIZED = 32

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("lut4_pairs_linear(Tensor x, Tensor codes, Tensor scales, Tensor table, Tensor global_multiplier, "
            "Tensor? bias, int group_size, int scale_format) -> Tensor")


def packable(weights: Lut4Weights, dtype: torch.dtype) -> bool:
    n, k = weights.codes.shape
    g = weights.group_size
    if not (dtype == torch.bfloat16 and n % OUTPUTS_PER_BLOCK == 0 and g % 2 == 0 and k % g == 0
            and weights.codes.device.type == "cpu" and native_cpu.available()):
        return False
    if weights.scale_format == "e8m0":  # the kernel reads exponents 1 .. 254 as fp32 exponent fields
        exponents = weights.scales.view(torch.uint8)
        return bool(exponents.min() >= 1 and exponents.max() <= 254)
    return True


def lut4_pairs_linear(x, codes, scales, table, global_multiplier, bias, group_size: int, scale_format: int):
    """x: [..., K] bf16; codes: uint8 [N / 64, K / 2, 64]. Returns [..., N]."""
    k = x.shape[-1]
    out = torch.ops.qrt_cpu.lut4_linear(x.reshape(-1, k), codes, table, scales, scale_format, global_multiplier,
                                        group_size, bias, MIN_ROWS_DEQUANTIZED)  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])


# CompositeImplicitAutograd: a compiled graph sees the kernel call itself.
_lib.impl("lut4_pairs_linear", lut4_pairs_linear, "CompositeImplicitAutograd")


class Lut4PairsLayout(Layout):
    """Codes in the 4-bit pairs layout, block scales per block of 64 outputs, the table and the
    global multiplier beside them."""

    name = "lut4-pairs"

    def pack(self, weights: Lut4Weights, dtype: torch.dtype) -> Packed:
        w = weights
        scales = w.scales.float() if w.scale_format == "fp32" else w.scales.view(torch.uint8)
        return Packed(
            {"weight": int4_pairs_cpu.pack_codes(w.codes.t()),  # [N / 64, K / 2, 64]
             "weight_scales": block_major(scales),  # [N / 64, K / G, 64]
             "weight_table": w.table.float().contiguous(),  # [16]
             "weight_global": w.global_multiplier()},  # [1]
            storage=f"4-bit table codes [N/64, K/2, 64] + {w.scale_format} scales per {w.group_size} "
                    f"[N/64, K/{w.group_size}, 64] ({bits_per_weight(w.group_size, w.scale_format):g} bits a weight)",
            constants={"lut4_group_size": w.group_size, "lut4_scale_format": SCALE_FORMATS[w.scale_format]})

    def linear(self, layer, x, *settings):
        return torch.ops.qrt.lut4_pairs_linear(x, layer.weight, layer.weight_scales, layer.weight_table,
                                               layer.weight_global, layer.bias, layer.lut4_group_size,
                                               layer.lut4_scale_format)


declare(Kernel(
    "qrt.lut4_pairs_linear", devices=("cpu",), serves=("qrt.lut4_linear",), layout=Lut4PairsLayout(),
    accepts=lambda weights, dtype: packable(weights, dtype),
    why="CPU: 4-bit table codes and their block scales as stored, looked up in registers (vpermw) by qrt's "
        "AVX-512 kernel"))
