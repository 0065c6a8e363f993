"""Multi-head latent attention (DeepSeek-V2/V3).

Each token's keys and values come from a latent of kv_lora_rank features (kv_a_proj_with_mqa, then
an RMSNorm) expanded per head by kv_b_proj, plus one rotary key of qk_rope_head_dim that every head
shares. The cache holds what the token produced before the expansion, the latent and the rotary key:
(kv_lora_rank + qk_rope_head_dim) values per token and layer, where multi-head attention would hold
num_heads * (qk_head_dim + v_head_dim) (DeepSeek-V3: 576 against 40960, 71x less).

Each step expands the attended latents with kv_b_proj, as transformers does. Folding kv_b_proj into
the query and output projections instead (attention over the latent itself, as DeepSeek's own
inference code does at decode) saves that matmul over the cache; it is a possible next step.

Rotary dims stored as interleaved pairs (the DeepSeek checkpoints') are regrouped into halves
before the rotation, for queries and keys alike: q·k is unchanged by the common permutation, and
the rotation becomes the rotate-half one every other family uses.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qrt.errors import UnsupportedError
from qrt.layers.linear import Linear

from .config import ModelConfig
from .layers import RMSNorm, apply_rope, attends_in_place, batch_rows, read_cache, write_cache


def halves_from_pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., 2n] with pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...]."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """forward(x, cos, sin, mask, positions, slots) as Attention's (layers.py), over a cache of
    latents [N, 1, S, kv_lora_rank] and rotary keys [N, 1, S, qk_rope_head_dim]."""

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype, *, norm_cls=RMSNorm, fused_checkpoint=False):
        super().__init__()
        mla, hidden = cfg.mla, cfg.hidden_size
        if cfg.parallel.sharded:
            raise UnsupportedError(f"{prefix}: multi-head latent attention runs with tp=1 only")
        if scheme.kv_cache_fp8 is not None:
            raise UnsupportedError(f"{prefix}: an fp8 KV cache is not supported with multi-head latent attention")
        self.mla, self.num_heads = mla, cfg.num_heads
        heads, qk = cfg.num_heads, mla.qk_head_dim

        def linear(name, k, n, bias=False):
            return Linear(k, [n], bias=bias, dtype=dtype, method=scheme.method_for(f"{prefix}.{name}"))

        if mla.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, heads * qk)
        else:
            self.q_a_proj = linear("q_a_proj", hidden, mla.q_lora_rank, mla.attention_bias)
            self.q_a_layernorm = norm_cls(mla.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = linear("q_b_proj", mla.q_lora_rank, heads * qk)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                         mla.attention_bias)
        self.kv_a_layernorm = norm_cls(mla.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = linear("kv_b_proj", mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = linear("o_proj", heads * mla.v_head_dim, hidden, mla.attention_bias)
        self.scale = qk ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        self.register_buffer("latent_cache", None, persistent=False)  # set by allocate_cache
        self.register_buffer("rope_cache", None, persistent=False)

    def allocate_cache(self, batch: int, length: int, dtype, device) -> None:
        self.latent_cache = torch.zeros(batch, 1, length, self.mla.kv_lora_rank, dtype=dtype, device=device)
        self.rope_cache = torch.zeros(batch, 1, length, self.mla.qk_rope_head_dim, dtype=dtype, device=device)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, cos, sin, mask, positions, slots):
        mla, heads = self.mla, self.num_heads
        bsz, seq, _ = x.shape
        q = self.queries(x).view(bsz, seq, heads, mla.qk_head_dim).transpose(1, 2)  # [B, H, T, qk]
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # [B, 1, T, kv_lora_rank]
        k_rot = k_rot.unsqueeze(1)  # [B, 1, T, rope]
        if mla.rope_interleaved:
            q_rot, k_rot = halves_from_pairs(q_rot), halves_from_pairs(k_rot)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        in_place = attends_in_place(positions, slots)
        if positions is not None:
            attended = mask.shape[-1]
            slots = batch_rows(slots)  # latent attention reads the cache out in every case
            write_cache(self.latent_cache, latent, positions, slots)
            write_cache(self.rope_cache, k_rot, positions, slots)
            latent = read_cache(self.latent_cache, slots, attended)  # [B, 1, S', r]
            k_rot = read_cache(self.rope_cache, slots, attended)  # [B, 1, S', rope]
        keys = latent.shape[2]
        kv = self.kv_b_proj(latent.squeeze(1)).view(bsz, keys, heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)  # [B, H, S', *]
        k = torch.cat([k_nope, k_rot.expand(bsz, heads, keys, mla.qk_rope_head_dim)], dim=-1)  # [B, H, S', qk]
        q = torch.cat([q_nope, q_rot], dim=-1)
        if in_place:
            out = attention_per_query(q, k, v, mask, self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.scale)  # [B, H, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, heads * mla.v_head_dim))


def attention_per_query(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [B, H, T, qk], k [B, H, S', qk], v [B, H, S', vd], mask [B, T, S'] bool (True = may attend)
    -> [B, H, T, vd] in q's dtype: scores, softmax and the weighted sum of V in fp32.

    For decode steps and speculative checks (T = 1 and T = 1 + k). Each query's scores are a sum
    over its own qk features and its output a sum over its own S' weights, so a query's arithmetic
    is the same whatever T is: a check scores each place exactly as the decode step feeding that
    token would. SDPA is not: its products are one GEMM for T > 1, which the compiler leaves to the
    BLAS, and a reduction the compiler writes for T = 1, and the two sum in different orders."""
    scores = (q.float().unsqueeze(3) * k.float().unsqueeze(2)).sum(-1) * scale  # [B, H, T, S']
    allowed = mask.unsqueeze(1)  # [B, 1, T, S']
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    probs = torch.where(allowed, probs, 0.0)  # a query allowed nothing gets zeros, as SDPA gives
    return (probs.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2).to(q.dtype)  # [B, H, T, vd]


def cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What the cache of a model with latent attention holds per token, over all its layers."""
    return cfg.num_layers * cfg.mla.cache_features_per_token() * dtype.itemsize
