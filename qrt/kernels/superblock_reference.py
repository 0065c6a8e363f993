"""The neutral form of weights with two levels of scales (llama.cpp's block types Q4_0 ... Q6_K),
and its plain-torch dequantization, the reference its kernels are held to.

A weight [N, K] holds unsigned codes of 4, 5 or 6 bits, a fixed zero point, and for each group of
G input channels a small integer scale (and offset) times an fp16 factor shared by a super-block
of S channels:

    W[n, k] = d[n, k // S] · sc[n, k // G] · (q[n, k] − zero) + dmin[n, k // S] · m[n, k // G]

An absent `sub_scales` reads as sc = 1, an absent `sub_offsets` as m = 1 and an absent
`super_offsets` as dmin = 0: Q4_0 is d · (q − 8) with G = S = 32; Q4_K is d · sc · q − dmin · m
with 6-bit sc and m per 32 and d, dmin per 256 (dmin stored negated); Q6_K is d · sc · (q − 32)
with int8 sc per 16.

The products are taken in fp32 in the order gguf-py's dequantizer takes them (d · sc first, then
times the centred code, plus dmin · m), so the reference equals it bit for bit.
"""

from dataclasses import dataclass

import torch


@dataclass
class SuperblockWeights:
    q: torch.Tensor  # uint8 [N, K], values < 2 ** bits
    bits: int  # 4, 5 or 6
    zero: int  # subtracted from every code
    group_size: int  # G: channels per sub-scale
    super_scales: torch.Tensor  # fp16 [N, K / S], d
    sub_scales: torch.Tensor | None = None  # int8 [N, K / G], sc (None: 1)
    super_offsets: torch.Tensor | None = None  # fp16 [N, K / S], dmin (None: no offset)
    sub_offsets: torch.Tensor | None = None  # int8 [N, K / G], m (None: 1)

    @property
    def super_size(self) -> int:
        """S: channels per fp16 factor."""
        return self.q.shape[1] // self.super_scales.shape[1]

    def group_factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale d · sc, offset dmin · m or None), fp32 [N, K / G] each."""
        per_super = self.super_size // self.group_size
        scale = self.super_scales.float().repeat_interleave(per_super, dim=1)  # [N, K / G]
        if self.sub_scales is not None:
            scale = scale * self.sub_scales.float()
        if self.super_offsets is None:
            return scale, None
        offset = self.super_offsets.float().repeat_interleave(per_super, dim=1)
        if self.sub_offsets is not None:
            offset = offset * self.sub_offsets.float()
        return scale, offset

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        n, k = self.q.shape
        scale, offset = self.group_factors()  # [N, K / G]
        codes = self.q.view(n, -1, self.group_size).float() - self.zero  # [N, K / G, G]
        values = scale[..., None] * codes
        if offset is not None:
            values = values + offset[..., None]
        return values.reshape(n, k)


def superblock_linear_reference(x: torch.Tensor, w: SuperblockWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in fp32 against the dequantized weight."""
    out = x.float() @ w.dequantize().t()
    return out if bias is None else out + bias.float()
