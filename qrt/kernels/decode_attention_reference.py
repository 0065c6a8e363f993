"""`qrt::decode_attention`: attention of one new token per batch row over that row's own part of
the KV cache, the logical op of a decode step (models/layers.py). Its implementation here is the
plain-torch reference; decode_attention_cpu.py declares qrt's AVX-512 kernel for it.

Each row attends over exactly its own live entries, read where they lie in the cache: no row
pays for a longer neighbour, and nothing about the other rows (their number, their lengths)
enters the row's arithmetic, so a request's tokens do not depend on its batch company.

The op is opaque to the compiler (its loop over rows reads their extents from tensors), with a
fake that gives the output's shape for tracing.
"""

import torch

from .choices import Kernel, declare
from .layouts import NamedLayout

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor first, Tensor last, "
            "float scale, float softcap, Tensor? k_scale, Tensor? v_scale, Tensor? sinks=None) -> Tensor")


def cache_values(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries in the model dtype: as stored, or e4m3 codes times their scale ([1] fp32),
    rounded to `dtype` (as models/layers.py reads an fp8 cache back)."""
    if scale is None:
        return cache
    return (cache.float() * scale).to(dtype)


def decode_attention(q, k_cache, v_cache, slots, first, last, scale: float, softcap: float, k_scale, v_scale,
                     sinks=None):
    """q: [B, H, hd], one token per row; k_cache, v_cache: [N, KVH, S, hd] (the model dtype, or
    e4m3 with k_scale / v_scale); slots, first, last: [B] int64. Row b attends over entries
    first[b] .. last[b] (inclusive) of cache row slots[b], its H query heads grouped by KV head
    (head i reads KV head i // (H / KVH)). Scores in fp32 times `scale`, passed through
    softcap * tanh(score / softcap) when softcap > 0 (Gemma 2), softmax and the weighted sum of V
    in fp32, rounded to q's dtype. sinks: [H] or None, a learned logit per query head that joins
    the softmax's denominator and weighs no value (gpt-oss). Returns [B, H, hd]."""
    rows, heads, hd = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty(rows, heads, hd, dtype=q.dtype, device=q.device)  # [B, H, hd]
    for b, (slot, lo, hi) in enumerate(zip(slots.tolist(), first.tolist(), last.tolist())):
        k = cache_values(k_cache[slot, :, lo:hi + 1], k_scale, q.dtype).float()  # [KVH, L, hd]
        v = cache_values(v_cache[slot, :, lo:hi + 1], v_scale, q.dtype).float()
        qg = q[b].float().view(kv_heads, heads // kv_heads, hd)  # [KVH, G, hd]
        scores = (qg @ k.transpose(-1, -2)) * scale  # [KVH, G, L]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.float().view(kv_heads, heads // kv_heads, 1)  # [KVH, G, 1]
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out[b] = (probs @ v).view(heads, hd).to(q.dtype)
    return out


_lib.impl("decode_attention", decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("qrt::decode_attention")
def _(q, k_cache, v_cache, slots, first, last, scale, softcap, k_scale, v_scale, sinks=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# The attention kernels read the KV cache as the model keeps it; nothing is packed for them.
KV_CACHE = NamedLayout("kv cache")

declare(Kernel(
    "qrt.decode_attention", devices=("cpu", "cuda"), serves=("qrt.decode_attention",), layout=KV_CACHE,
    recorded_as="attention_kernel",
    preference=100, why="plain torch, one row at a time over its own cache entries"))
