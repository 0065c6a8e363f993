"""4-bit codes that index a 16-entry table of values, times a scale per block of input channels:
the plain-torch reference and the logical op `qrt::lut4_linear`.

One computation serves the 4-bit formats whose codes are not integers: bitsandbytes' NF4 (the
normal distribution's quantiles) and FP4, and the FP4 E2M1 codes of NVFP4 and MXFP4. For a weight
[N, K] in blocks of G input channels,

    W[n, k] = table[q[n, k]] · s[n, k // G],   s = decode(scales) · global   (or ÷ global)

where `scales` are fp32 values (bitsandbytes' absmax, already double-dequantized), or the bits of
an e4m3 value (NVFP4, G = 16, with a per-tensor global scale) or of an e8m0 power of two
(MXFP4, G = 32). Products are taken in fp32 in the order the producers' own dequantizers take
them, so `Lut4Weights.dequantize()` equals them bit for bit: compressed-tensors divides its block
scale by the global scale, ModelOpt multiplies.

The reference layout keeps the codes as a checkpoint does, two a byte (the low nibble first), with
the scales as stored: 4 bits a weight plus the scales' 0.25-2 bits.
"""

from dataclasses import dataclass

import torch

from .choices import Kernel, declare
from .layouts import Layout, Packed

# FP4 E2M1 (1 sign, 2 exponent, 1 mantissa bit; the OCP Microscaling spec): code 0b0eem is
# (1 + m / 2) · 2 ** (ee - 1) for ee > 0 and m / 2 for ee = 0; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# How a block's scale is stored: the integer each format's op argument carries.
SCALE_FORMATS = {"fp32": 0, "e4m3": 1, "e8m0": 2}


def e2m1_table() -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32)  # [16]


def decode_scales(scales: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Stored block scales -> fp32, exactly: fp32 as they are; e4m3 from its bits (uint8 or
    float8_e4m3fn); e8m0 as 2 ** (e - 127) (e = 255, NaN in the spec, is not expected here)."""
    if scale_format == "fp32":
        return scales.float()
    if scale_format == "e4m3":
        return scales.view(torch.float8_e4m3fn).float()
    if scale_format == "e8m0":
        exponents = scales.view(torch.uint8).int() - 127
        return torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    raise ValueError(f"unknown block scale format {scale_format!r}; known: {sorted(SCALE_FORMATS)}")


@dataclass
class Lut4Weights:
    """One layer's table-lookup weights, unpacked: the neutral form every format of this family
    describes its weights in, and every layout of `qrt::lut4_linear` packs from."""

    codes: torch.Tensor  # uint8 [N, K]: table indices, < 16
    table: torch.Tensor  # fp32 [16]: the value of each code
    group_size: int  # G: input channels per block scale
    scales: torch.Tensor  # [N, K / G]: fp32 values, or the uint8 bits of e4m3 / e8m0 values
    scale_format: str = "fp32"  # "fp32", "e4m3" or "e8m0"
    global_scale: torch.Tensor | None = None  # fp32 [] applied to every block scale, or None
    global_divides: bool = False  # the block scale is divided by `global_scale` (compressed-tensors)

    def block_scales(self) -> torch.Tensor:
        """fp32 [N, K / G]: decode(scales), then times or divided by the global scale."""
        s = decode_scales(self.scales, self.scale_format)
        if self.global_scale is None:
            return s
        g = self.global_scale.float()
        return s / g if self.global_divides else s * g

    def global_multiplier(self) -> torch.Tensor:
        """fp32 [1]: what a kernel multiplies each decoded block scale by (1 / global when the
        format divides: within an ulp of the division)."""
        if self.global_scale is None:
            return torch.ones(1, dtype=torch.float32, device=self.codes.device)
        g = self.global_scale.float().reshape(1)
        return 1.0 / g if self.global_divides else g.clone()

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        n, k = self.codes.shape
        values = self.table.to(self.codes.device)[self.codes.long()]  # [N, K]
        return (values.view(n, -1, self.group_size) * self.block_scales()[..., None]).view(n, k)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes < 16 -> uint8 [..., K / 2], element 2 i in the low nibble of byte i."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 [..., K / 2] -> uint8 [..., K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def lut4_linear_reference(x, packed, scales, table, global_scale, bias, group_size: int, scale_format: int,
                          global_divides: bool):
    """x [..., K] against the weight `packed` (uint8 [N, K / 2]) describes; fp32 arithmetic,
    the result in x's dtype."""
    fmt = {v: k for k, v in SCALE_FORMATS.items()}[scale_format]
    weights = Lut4Weights(unpack_nibbles(packed), table, group_size, scales, fmt, global_scale, global_divides)
    out = x.float() @ weights.dequantize().t()  # [..., N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@torch.library.custom_op("qrt::lut4_linear", mutates_args=())
def lut4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, table: torch.Tensor,
                global_scale: torch.Tensor | None, bias: torch.Tensor | None, group_size: int, scale_format: int,
                global_divides: bool) -> torch.Tensor:
    """Logical table-lookup 4-bit linear: x [..., K], packed uint8 [N, K / 2], scales [N, K / G],
    table fp32 [16], global_scale fp32 [] or None, bias [N] or None -> [..., N]."""
    return lut4_linear_reference(x, packed, scales, table, global_scale, bias, group_size, scale_format,
                                 global_divides)


@lut4_linear.register_fake
def _(x, packed, scales, table, global_scale, bias, group_size, scale_format, global_divides):
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def bits_per_weight(group_size: int, scale_format: str) -> float:
    return 4 + (32 if scale_format == "fp32" else 8) / group_size


class Lut4CodesLayout(Layout):
    """The codes two a byte as stored, the scales as stored: what the reference and the Triton
    kernel read. Tensors: `weight` uint8 [N, K / 2], `weight_scales` [N, K / G], `weight_table`
    fp32 [16], `weight_global` fp32 [] or absent."""

    name = "lut4"

    def pack(self, weights: Lut4Weights, dtype: torch.dtype) -> Packed:
        w = weights
        return Packed(
            {"weight": pack_nibbles(w.codes),  # [N, K / 2]
             "weight_scales": w.scales.contiguous(),  # [N, K / G]
             "weight_table": w.table.float().contiguous(),  # [16]
             "weight_global": None if w.global_scale is None else w.global_scale.float().reshape(())},
            storage=f"4-bit table codes [N, K/2] + {w.scale_format} scales per {w.group_size} "
                    f"({bits_per_weight(w.group_size, w.scale_format):g} bits a weight)",
            constants={"lut4_group_size": w.group_size, "lut4_scale_format": SCALE_FORMATS[w.scale_format],
                       "lut4_global_divides": w.global_divides})

    def linear(self, layer, x, *settings):
        return torch.ops.qrt.lut4_linear(x, layer.weight, layer.weight_scales, layer.weight_table,
                                         layer.weight_global, layer.bias, layer.lut4_group_size,
                                         layer.lut4_scale_format, layer.lut4_global_divides)

    gathers_rows = True

    def rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        fmt = {v: k for k, v in SCALE_FORMATS.items()}[layer.lut4_scale_format]
        weights = Lut4Weights(unpack_nibbles(layer.weight[flat]), layer.weight_table, layer.lut4_group_size,
                              layer.weight_scales[flat], fmt, layer.weight_global, layer.lut4_global_divides)
        return weights.dequantize().reshape(*ids.shape, -1).to(layer.params_dtype)


LUT4_CODES = Lut4CodesLayout()

declare(Kernel("qrt.lut4_linear", devices=("cpu", "cuda"), serves=("qrt.lut4_linear",), layout=LUT4_CODES,
               preference=100, why="the plain-torch reference: the weight dequantized to fp32 on every call"))
