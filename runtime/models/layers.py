"""Building blocks shared by the decoder models: linear layers with pluggable quantization,
RMSNorm, rotary embeddings, attention over a static KV cache, and the gated MLP.

Written for `torch.compile(fullgraph=True)`: no data-dependent Python control flow in `forward`,
no reads of parameter attributes in `forward`, caches preallocated as buffers.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from loaders.errors import UnsupportedError
from loaders.kv_cache import create_kv_scales, dequantize_kv, quantize_kv
from loaders.parameters import make_parameter
from loaders.shards import ShardLayout, copy_rows

from .config import ModelConfig


class Linear(nn.Module):
    """y = x Wᵀ (+ b) whose weights are created, loaded and run by a quantization method.

    output_sizes has one entry per shard of a fused layer (q/k/v, gate/up) with matching
    shard_ids; the checkpoint's per-shard tensors are loaded into their rows.
    """

    def __init__(self, input_size: int, output_sizes, *, bias: bool, method, dtype, shard_ids=None):
        super().__init__()
        self.input_size = input_size
        self.output_size = sum(output_sizes)
        self.has_bias = bias
        self.params_dtype = dtype
        self.shard_layout = None if shard_ids is None else ShardLayout.stacked(shard_ids, output_sizes)
        self.quant_method = method
        self.register_parameter("bias", None)
        method.create_weights(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.has_bias}, quant={self.quant_method.name}"


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = make_parameter(torch.empty(size, dtype=dtype), weight_loader=_copy_whole)  # [D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the model dtype, as transformers' Llama does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, size: int, dtype):
        super().__init__()
        self.weight = make_parameter(
            torch.empty(vocab_size, size, dtype=dtype),  # [V, D]
            weight_loader=_copy_whole, output_dim=0, input_dim=1, quant_format="bf16",
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _copy_whole(param, loaded, shard_id):
    copy_rows(param, loaded, shard_id, layout=None)


def rope_inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with the config's RoPE scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling).float()
    raise UnsupportedError(f"rope_scaling type {kind!r} is not supported yet; supported: linear, llama3")


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 RoPE: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_factor = float(scaling.get("low_freq_factor", 1.0))
    high_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / low_factor
    high_freq_wavelen = old_context / high_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_tables(cfg: ModelConfig, length: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [length, head_dim], in the model dtype (angles computed in fp32)."""
    inv_freq = rope_inverse_frequencies(cfg).to(device)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # [length, head_dim], rotate-half layout
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, hd]; cos/sin: [T, hd]. Rotate-half convention (as HF checkpoints use)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.qkv_bias, dtype=dtype,
            shard_ids=("q", "k", "v"), method=scheme.method_for([f"{prefix}.{p}_proj" for p in "qkv"]),
        )
        self.o_proj = Linear(
            q_size, [cfg.hidden_size], bias=False, dtype=dtype, method=scheme.method_for(f"{prefix}.o_proj")
        )
        self.register_buffer("k_cache", None, persistent=False)  # set by allocate_cache
        self.register_buffer("v_cache", None, persistent=False)
        self.fp8_cache = scheme.kv_cache_fp8 is not None
        if self.fp8_cache:
            create_kv_scales(self, scheme.kv_cache_fp8)

    def allocate_cache(self, batch: int, length: int, dtype, device) -> None:
        shape = (batch, self.num_kv_heads, length, self.head_dim)  # [B, KVH, S, hd]
        dtype = torch.float8_e4m3fn if self.fp8_cache else dtype
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x, cos, sin, mask, input_pos):
        """x: [B, T, D]; cos/sin: [T, hd]; mask: [T, S] bool (True = may attend);
        input_pos: [T] positions to write into the KV cache, or None to attend within x only."""
        bsz, seq, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KVH, T, hd]
        v = v.view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if input_pos is not None:
            k_cache, v_cache = self.k_cache[:bsz], self.v_cache[:bsz]
            if self.fp8_cache:
                k_cache.index_copy_(2, input_pos, quantize_kv(k, self.k_scale))
                v_cache.index_copy_(2, input_pos, quantize_kv(v, self.v_scale))
                k = dequantize_kv(k_cache, self.k_scale, q.dtype)  # [B, KVH, S, hd]
                v = dequantize_kv(v_cache, self.v_scale, q.dtype)
            else:
                k_cache.index_copy_(2, input_pos, k)
                v_cache.index_copy_(2, input_pos, v)
                k, v = k_cache, v_cache  # [B, KVH, S, hd]
        # Grouped-query attention without copying K/V per query head: the G query heads that
        # share a KV head are folded into the query-length axis, and the mask repeated to match.
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(bsz, self.num_kv_heads, group * seq, self.head_dim)  # [B, KVH, G*T, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(group, 1))
        out = out.view(bsz, self.num_heads, seq, self.head_dim).transpose(1, 2).reshape(bsz, seq, q_size)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, [inter, inter], bias=False, dtype=dtype, shard_ids=(0, 1),
            method=scheme.method_for([f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
        )
        self.down_proj = Linear(
            inter, [cfg.hidden_size], bias=False, dtype=dtype, method=scheme.method_for(f"{prefix}.down_proj")
        )

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", scheme, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg, f"{prefix}.mlp", scheme, dtype)

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))
