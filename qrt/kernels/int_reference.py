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

import torch

SUPPORTED_BITS = (2, 4, 8)


def pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit integer weights are not supported; supported: {SUPPORTED_BITS}")
    return 32 // bits


# Columns packed or unpacked at a time: the int64 temporaries of a whole lm_head (49152 columns)
# came to several hundred MiB, the peak of loading an int4 model.
_COLUMNS_PER_CHUNK = 4096


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-wide values along dim 0, LSB-first, into int32 words.

    values: [R, C] integers in [0, 2**bits). Returns int32 [ceil(R / pf), C]; the tail of the
    last word is zero.
    """
    pf = pack_factor(bits)
    rows, cols = values.shape
    out = torch.empty(-(-rows // pf), cols, dtype=torch.int32, device=values.device)
    shifts = (torch.arange(pf, device=values.device, dtype=torch.int64) * bits)[None, :, None]
    for start in range(0, cols, _COLUMNS_PER_CHUNK):
        part = values[:, start : start + _COLUMNS_PER_CHUNK]
        padded = torch.zeros(out.shape[0] * pf, part.shape[1], dtype=torch.int64, device=values.device)
        padded[:rows] = part.to(torch.int64)
        words = (padded.view(-1, pf, part.shape[1]) << shifts).sum(dim=1)  # [R / pf, c], fields never overlap
        out[:, start : start + part.shape[1]] = _as_int32(words)
    return out


def unpack_rows(packed: torch.Tensor, bits: int, rows: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 [ceil(rows / pf), C] -> [rows, C] unsigned values in `dtype`
    (int32, or uint8 for bits <= 8)."""
    pf = pack_factor(bits)
    if bits == 8 and dtype == torch.uint8 and sys.byteorder == "little":
        # Byte i of each word is row 4 r + i (LSB-first): a view and one copy, where the shifts
        # below make int64 temporaries of 32x the codes' size per chunk.
        as_bytes = packed.contiguous().view(torch.uint8).view(packed.shape[0], packed.shape[1], 4)  # [R / 4, C, 4]
        return as_bytes.permute(0, 2, 1).reshape(-1, packed.shape[1])[:rows].contiguous()
    out = torch.empty(rows, packed.shape[1], dtype=dtype, device=packed.device)
    shifts = (torch.arange(pf, device=packed.device, dtype=torch.int64) * bits)[None, :, None]
    for start in range(0, packed.shape[1], _COLUMNS_PER_CHUNK):
        words = packed[:, start : start + _COLUMNS_PER_CHUNK].to(torch.int64) & 0xFFFFFFFF  # as unsigned
        fields = (words[:, None, :] >> shifts) & ((1 << bits) - 1)  # [R / pf, pf, c]
        out[:, start : start + words.shape[1]] = fields.reshape(-1, words.shape[1])[:rows]
    return out


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 bit patterns -> the same bits as int32 (two's-complement wrap)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


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
