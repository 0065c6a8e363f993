"""Plain-torch reference for integer weight-only linears (W4A16, W8A16, W2A16) and the
logical op `qrt::int_linear` that those layers call.

Every integer checkpoint format (GPTQ, AWQ, compressed-tensors) is converted by its loader pass
into one canonical layout, which this reference and the GPU kernel read:

- qweight: int32 [ceil(K / pf), N], pf = 32 // bits values per word, packed along K
  LSB-first (input channel k of column n sits at word k // pf, bits bits * (k % pf)). Values
  are unsigned, in [0, 2**bits).
- scales, zeros: [ceil(K / G), N] floats, one row per group of G consecutive input channels (the
  last group may be partial). zeros are zero points in units of the scale (checkpoint formats
  store integers, online int4 uses fractional ones), so
  W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n].
- perm: int64 [K] or None. Act-order checkpoints have their input channels reordered so that
  groups are contiguous; the activation columns are then gathered with `perm` to match.
"""

import sys
from dataclasses import dataclass

import torch

from .layouts import Layout, Packed

SUPPORTED_BITS = (2, 4, 8)


@dataclass
class IntWeights:
    """One layer's integer weights, unpacked, the neutral form every integer format's loader pass
    makes and every layout of `qrt::int_linear` packs from:
    W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n], with g(k) = g_idx[k] when given, else
    k // group_size."""

    q: torch.Tensor  # [K, N] int32 (or uint8), unsigned values in [0, 2**bits)
    scales: torch.Tensor  # [ceil(K / G), N] float
    zeros: torch.Tensor  # [ceil(K / G), N] float, zero points in units of the scale (may be fractional)
    bits: int
    group_size: int  # G; equal to K for one group per channel
    g_idx: torch.Tensor | None = None  # [K] group of each input channel (act-order checkpoints)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], the weight in nn.Linear orientation."""
        k = self.q.shape[0]
        group = self.g_idx.long() if self.g_idx is not None else torch.arange(k, device=self.q.device) // self.group_size
        return ((self.q.float() - self.zeros.float()[group]) * self.scales.float()[group]).t()


def pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit integer weights are not supported; supported: {SUPPORTED_BITS}")
    return 32 // bits


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-wide values along dim 0, LSB-first, into int32 words.

    values: [R, C] integers in [0, 2**bits). Returns int32 [ceil(R / pf), C]; the tail of the
    last word is zero.
    """
    pf = pack_factor(bits)
    rows, cols = values.shape
    words = -(-rows // pf)
    codes = values.to(torch.int32)
    if words * pf != rows:
        codes = torch.cat([codes, codes.new_zeros(words * pf - rows, cols)])
    fields = codes.view(words, pf, cols)  # [R / pf, pf, C]: field i of each word
    # In int32 throughout: the fields never overlap, and the top field's high bit shifts into
    # the sign bit, which is the packed word's bit pattern. (int64 temporaries of the whole
    # tensor made loading an int4 model take seconds.)
    out = fields[:, 0].clone()
    for field in range(1, pf):
        out |= fields[:, field] << (field * bits)
    return out


def unpack_rows(packed: torch.Tensor, bits: int, rows: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 [ceil(rows / pf), C] -> [rows, C] unsigned values in `dtype`
    (int32, or uint8 for bits <= 8)."""
    pf = pack_factor(bits)
    if bits == 8 and dtype == torch.uint8 and sys.byteorder == "little":
        # Byte i of each word is row 4 r + i (LSB-first): a view and one copy.
        as_bytes = packed.contiguous().view(torch.uint8).view(packed.shape[0], packed.shape[1], 4)  # [R / 4, C, 4]
        return as_bytes.permute(0, 2, 1).reshape(-1, packed.shape[1])[:rows].contiguous()
    out = torch.empty(packed.shape[0], pf, packed.shape[1], dtype=dtype, device=packed.device)  # [R / pf, pf, C]
    mask = (1 << bits) - 1
    for field in range(pf):
        # An arithmetic shift of a negative word brings copies of the sign bit in from the top;
        # the mask keeps only the field.
        out[:, field] = (packed >> (field * bits)) & mask
    return out.view(-1, packed.shape[1])[:rows].contiguous()


def dequantize_int(qweight, scales, zeros, bits: int, group_size: int, k: int) -> torch.Tensor:
    """The canonical layout's weight as fp32 [K, N] (transposed, K-major, as stored)."""
    q = unpack_rows(qweight, bits, k).float()  # [K, N]
    group = torch.arange(k, device=qweight.device) // group_size  # [K] group of each input channel
    return (q - zeros.float()[group]) * scales.float()[group]


def int_linear_reference(x, qweight, scales, zeros, perm, bias, bits: int, group_size: int) -> torch.Tensor:
    """y = x[..., perm] @ W + bias, with W dequantized in fp32 and the product summed in fp32.

    x: [..., K] bf16/fp16/fp32. Returns [..., N] in x.dtype.
    """
    k = x.shape[-1]
    w = dequantize_int(qweight, scales, zeros, bits, group_size, k)  # [K, N] fp32
    x2 = x.reshape(-1, k).float()  # [M, K]
    if perm is not None:
        x2 = x2.index_select(1, perm)
    out = x2 @ w
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[1])


@torch.library.custom_op("qrt::int_linear", mutates_args=())
def int_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """Logical integer weight-only linear op (canonical layout, see the module docstring)."""
    return int_linear_reference(x, qweight, scales, zeros, perm, bias, bits, group_size)


@int_linear.register_fake
def _(x, qweight, scales, zeros, perm, bias, bits, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[1])


def _exact_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` when that loses nothing (e.g. fp16 scales in an fp16 model), else in fp32."""
    narrowed = t.to(dtype)
    return narrowed if torch.equal(narrowed.float(), t.float()) else t.float()


class CanonicalIntLayout(Layout):
    """The canonical layout above, which this reference and the Triton kernel read. The layer
    calls the logical op; on a GPU the swap pass puts the kernel in its place."""

    name = "packed"

    def pack(self, weights: IntWeights, dtype: torch.dtype) -> Packed:
        w = weights
        return Packed(
            {"weight": pack_rows(w.q, w.bits),  # [K / pf, N] int32
             "scales": _exact_dtype(w.scales, dtype).contiguous(),  # [K / G, N]
             "zeros": _exact_dtype(w.zeros, dtype).contiguous()},  # [K / G, N]
            storage=f"int{w.bits} words along K [K/{32 // w.bits}, N], g{w.group_size}",
            weight_attributes=dict(packed_dim=0, packed_factor=32 // w.bits, group_size=w.group_size))

    def linear(self, layer, x, bits: int, group_size: int):
        return torch.ops.qrt.int_linear(x, layer.weight, layer.scales, layer.zeros, layer.perm, layer.bias,
                                        bits, group_size)


CANONICAL_INT = CanonicalIntLayout()
