"""Building blocks shared by the decoder models: RMSNorm, rotary embeddings, attention over a
static KV cache, and the gated MLP.

Linear layers come from the quantized-linear contract (qrt.layers.linear): a layer asks the
model's QuantScheme for the LinearMethod of its checkpoint modules and never looks further.

Written for `torch.compile(fullgraph=True)`: no data-dependent Python control flow in `forward`,
no reads of parameter attributes in `forward`, caches preallocated as buffers.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.choices import choose

from qrt.layers.linear import Linear, copy_rows, create_kv_scales, dequantize_kv, make_parameter, quantize_kv
from qrt.layers.tensor_parallel import SINGLE, Parallelism, TensorSplit, all_reduce

from .config import SLIDING_ATTENTION, ModelConfig, Rope


class RMSNorm(nn.Module):
    """qrt::rms_norm (qrt/kernels/activation_reference.py): normalise in fp32, scale in the model
    dtype, as transformers' Llama does."""

    unit_offset = False  # the weight is stored as its offset from one (Gemma)

    def __init__(self, size: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = make_parameter(torch.empty(size, dtype=dtype), weight_loader=_copy_whole)  # [D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qrt.rms_norm(x, self.weight, self.eps, self.unit_offset)


class Embedding(nn.Module):
    """Token embeddings; in a sharded model each rank holds a slice of the vocabulary
    (tensor_parallel.Parallelism.vocab): a token outside it looks up zeros, and the sum over the
    ranks gives every rank its row."""

    def __init__(self, vocab_size: int, size: int, dtype, parallel: Parallelism = SINGLE):
        super().__init__()
        self.parallel = parallel
        vocab = parallel.vocab(vocab_size)
        self.rows_held = vocab.length  # this rank's rows, padding included
        self.n_slices = (vocab,) if parallel.sharded else None  # read by the loader
        self.k_slice = None
        self.first_id = vocab.start
        self.weight = make_parameter(
            torch.empty(vocab.length, size, dtype=dtype),  # [V / tp (padded), D]
            weight_loader=_copy_whole, output_dim=0, input_dim=1, quant_format="bf16",
        )

    def tensor_split(self, param_name: str) -> TensorSplit:
        return TensorSplit(n_dim=0, k_dim=None)  # vocabulary rows; every rank holds all D columns

    # The output layer whose weight holds this embedding's values (share_rows_of), or None.
    rows_of = None

    def share_rows_of(self, output) -> None:
        """Look rows up in `output`'s packed weight from now on, and drop this copy of them:
        `output` (the lm_head, split over the vocabulary as this embedding is) holds the same values,
        in a layout whose `rows` reads them back (a GGUF's output layer made from its quantized
        embedding: the one copy that stays is a byte a weight, not two)."""
        self.__dict__["rows_of"] = output  # a plain reference: the lm_head stays the model's module, not ours
        del self.weight

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_of is not None:
            return self.rows_of.quant_method.layout.rows(self.rows_of, ids)  # [B, T, D]
        return F.embedding(ids, self.weight)  # [B, T, D]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.sharded:
            return self._lookup(ids)
        local = ids - self.first_id  # [B, T]
        held = (local >= 0) & (local < self.rows_held)
        rows = self._lookup(local.clamp(0, self.rows_held - 1))  # [B, T, D]
        return all_reduce(rows * held.unsqueeze(-1).to(rows.dtype), self.parallel)


def _copy_whole(param, loaded, shard_id):
    copy_rows(param, loaded, shard_id, layout=None)


def rope_frequencies(rope: Rope, long: bool = False) -> tuple[torch.Tensor, float]:
    """[rope.dim // 2] fp32 inverse frequencies with the scaling applied, and the factor that
    yarn and longrope multiply cos and sin by. long: longrope's factors for long sequences."""
    dim = rope.dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = rope.scaling
    if rope.kind == "default":
        return inv_freq.float(), 1.0
    if rope.kind == "linear":
        return (inv_freq / float(scaling["factor"])).float(), 1.0
    if rope.kind == "llama3":
        return _llama3_scaling(inv_freq, scaling).float(), 1.0
    if rope.kind == "yarn":
        return _yarn_scaling(inv_freq, rope), _yarn_attention_factor(scaling)
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)  # [dim // 2]
    return (inv_freq / factors).float(), _longrope_attention_factor(scaling)


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


def _yarn_scaling(inv_freq: torch.Tensor, rope: Rope) -> torch.Tensor:
    """YaRN: dims that turn more than beta_fast times within the original context keep their
    frequency, those turning fewer than beta_slow times are slowed by `factor`, a linear ramp between."""
    scaling, dim = rope.scaling, rope.dim
    factor, context = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def dim_turning(turns):  # the (fractional) dim whose wavelength fits `turns` times in the context
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dim ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [dim // 2]
    return (inv_freq / factor * ramp + inv_freq * (1 - ramp)).float()


def _yarn_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


def _longrope_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, context = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(context))


def rope_tables(rope: Rope, length: int, dtype, device, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [length, rope.dim], in the model dtype (angles computed in fp32)."""
    inv_freq, attention_factor = rope_frequencies(rope, long)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq.to(device))
    angles = torch.cat([angles, angles], dim=-1)  # [length, rope.dim], rotate-half layout
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position of the static cache for one Rope, looked up by position."""

    def __init__(self, rope: Rope):
        super().__init__()
        self.rope = rope
        # Longrope, as transformers runs it, uses its long factors for every position of a
        # forward pass that reaches past the original context, its short factors otherwise.
        self.long_from = rope.scaling["original_max_position_embeddings"] if rope.kind == "longrope" else None
        for name in ("cos", "sin", "long_cos", "long_sin"):
            self.register_buffer(name, None, persistent=False)  # set by allocate

    def allocate(self, length: int, dtype, device) -> None:
        self.cos, self.sin = rope_tables(self.rope, length, dtype, device)  # [S, rope.dim] each
        if self.long_from is not None:
            self.long_cos, self.long_sin = rope_tables(self.rope, length, dtype, device, long=True)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, T] (each row its own) -> cos, sin: [B, 1, T, rope.dim], broadcasting over heads."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if self.long_from is None:
            return cos, sin
        # Per row: long factors once the row reaches past the original context. [B, 1, 1, 1]
        # bool: a select in the graph, not a branch.
        long = (positions.amax(dim=-1) >= self.long_from).view(-1, 1, 1, 1)
        long_cos, long_sin = self.long_cos[positions].unsqueeze(1), self.long_sin[positions].unsqueeze(1)
        return torch.where(long, long_cos, cos), torch.where(long, long_sin, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, hd]; cos/sin: [B, 1, T, rot]. Rotate-half convention (as HF checkpoints use);
    with rot < hd only the first rot dims rotate (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention over a static KV cache.

    norm_cls: the norm of q/k heads when cfg.qk_norm; fused_checkpoint: the checkpoint stores
    q/k/v as one `qkv_proj` tensor (Phi-3), which then loads whole instead of by shards."""

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype, *, norm_cls, fused_checkpoint: bool):
        super().__init__()
        tp, hd = cfg.parallel, cfg.head_dim
        # Column-parallel q/k/v by heads (KV heads replicated when there are fewer than ranks),
        # row-parallel o_proj: this rank attends with its own heads.
        q_part = tp.heads(cfg.num_heads, hd, f"{prefix}: num_attention_heads", replicate=False)
        kv_part = tp.heads(cfg.num_kv_heads, hd, f"{prefix}: num_key_value_heads", replicate=True)
        self.num_heads, self.num_kv_heads, self.head_dim = q_part.length // hd, kv_part.length // hd, hd
        q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        if fused_checkpoint:
            shards = dict(method=scheme.method_for(f"{prefix}.qkv_proj"))
        else:
            shards = dict(shard_ids=("q", "k", "v"), method=scheme.method_for([f"{prefix}.{p}_proj" for p in "qkv"]))
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.qkv_bias, dtype=dtype,
                               parallel=tp, n_slices=[q_part, kv_part, kv_part], **shards)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias=False, dtype=dtype,
                             method=scheme.method_for(f"{prefix}.o_proj"), parallel=tp, k_slice=q_part)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.scale = cfg.head_dim ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        self.softcap = cfg.attn_logit_softcap
        # Set by the decoder layer: how many entries a sliding-window layer attends over (None: all).
        self.sliding_window = None
        # [H] per query head, a learned logit in every softmax's denominator; families with attention
        # sinks (gpt-oss) register it.
        self.register_parameter("sinks", None)
        self.register_buffer("k_cache", None, persistent=False)  # set by allocate_cache
        self.register_buffer("v_cache", None, persistent=False)
        self.fp8_cache = scheme.kv_cache_fp8 is not None
        if self.fp8_cache:
            create_kv_scales(self)

    def allocate_cache(self, batch: int, length: int, dtype, device) -> None:
        shape = (batch, self.num_kv_heads, length, self.head_dim)  # [B, KVH, S, hd]
        dtype = torch.float8_e4m3fn if self.fp8_cache else dtype
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        # The decode-attention kernel for this cache, which the attention swap pass reads from the
        # op's k_cache argument (qrt/passes/swap_attention.py).
        self.k_cache.attention_kernel = choose("qrt.decode_attention", device.type, head_dim=self.head_dim,
                                     group=self.num_heads // self.num_kv_heads).op

    def _write_cache(self, k, v, positions, slots) -> None:
        """Store k, v ([B, KVH, T, hd]) at `positions` of cache rows `slots` (quantized first for
        an fp8 cache)."""
        if self.fp8_cache:
            k, v = quantize_kv(k, self.k_scale), quantize_kv(v, self.v_scale)
        write_cache(self.k_cache, k, positions, slots)
        write_cache(self.v_cache, v, positions, slots)

    def _in_place_attention(self, q, k, v, positions, slots):
        """New tokens (q [B, H, T, hd], k/v [B, KVH, T, hd] at positions [B, T], batch row b in
        cache row slots[b, 0], or b where slots is None) attending over their row's live cache
        entries up to each token's own position, with qrt.decode_attention (the kernel chosen in allocate_cache
        replaces it when compiled). A decode step feeds T = 1; a speculative check feeds the
        next token and its guesses (T = 1 + k), each attending like the decode step that would
        have fed it, so both give a token the same attention. A token at the cache's last
        position is idle (GraphRunner.idle_decode_rows): it attends only to the entry it
        writes. Returns [B, T, H * hd]."""
        bsz, _, seq, _ = q.shape
        self._write_cache(k, v, positions, batch_rows(slots))
        last = positions.reshape(-1)  # [B*T]
        first = torch.zeros_like(last) if self.sliding_window is None else (last - self.sliding_window + 1).clamp(min=0)
        first = torch.where(last == self.k_cache.shape[2] - 1, last, first)
        if slots is None:
            slots = torch.arange(bsz, device=q.device).repeat_interleave(seq)  # [B*T]: each token's cache row
        else:
            slots = slots.reshape(-1)
        scale_k, scale_v = (self.k_scale, self.v_scale) if self.fp8_cache else (None, None)
        queries = q.transpose(1, 2).reshape(bsz * seq, self.num_heads, self.head_dim)  # [B*T, H, hd]
        sinks = () if self.sinks is None else (self.sinks,)  # absent for the kernels that have no sinks
        out = torch.ops.qrt.decode_attention(queries, self.k_cache, self.v_cache, slots, first, last, self.scale,
                                             self.softcap or 0.0, scale_k, scale_v, *sinks)
        return out.view(bsz, seq, self.num_heads * self.head_dim)

    def forward(self, x, cos, sin, mask, positions, slots):
        """x: [B, T, D]; cos/sin: [B, 1, T, rot]; mask: [B, T, S'] bool (True = may attend) over
        the first S' cache entries. positions: [B, T], where each row writes its K/V in the cache,
        or None to attend within x only. slots: where the rows' keys and values go in the cache:
        [B], the cache row of each batch row (a prefill chunk: it attends over the cache read out,
        with SDPA); [B, T], each token's (every token of a row in the row's cache row: decode or
        a speculative check of chosen rows, attending in place); None, batch row b is cache row b
        (the whole cache's decode or check, in place)."""
        bsz, seq, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim  # this rank's
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KVH, T, hd]
        v = v.view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attends_in_place(positions, slots):
            return self.o_proj(self._in_place_attention(q, k, v, positions, slots))
        if positions is not None:
            attended = mask.shape[-1]  # S': the cache entries this call attends over
            self._write_cache(k, v, positions, slots)
            k = read_cache(self.k_cache, slots, attended)  # [B, KVH, S', hd]
            v = read_cache(self.v_cache, slots, attended)
            if self.fp8_cache:
                k, v = dequantize_kv(k, self.k_scale, q.dtype), dequantize_kv(v, self.v_scale, q.dtype)
        # Grouped-query attention without copying K/V per query head: the G query heads that
        # share a KV head are folded into the query-length axis, and the mask repeated to match.
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(bsz, self.num_kv_heads, group * seq, self.head_dim)  # [B, KVH, G*T, hd]
        mask = mask.repeat(1, group, 1).unsqueeze(1)  # [B, 1, G*T, S']
        if self.sinks is not None:
            out = attention_with_sinks(q, k, v, mask, self.scale, self.sinks)
        elif self.softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            out = softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        # reshape, not view: CUDA's attention kernels may return another memory layout than the CPU's.
        out = out.reshape(bsz, self.num_heads, seq, self.head_dim).transpose(1, 2).reshape(bsz, seq, q_size)
        return self.o_proj(out)


def write_cache(cache, new, positions, slots) -> None:
    """Write `new` ([B, KVH, T, hd]) into `cache` ([N, KVH, S, hd]) at each row's `positions`
    ([B, T]) in cache row `slots[b]` (or b).

    One flat index_copy_ over [N * KVH * S, hd] rows, because every batch row writes at positions
    of its own. An fp8 cache is written as bytes: ATen's CPU index_copy_ has no fp8 kernel."""
    rows, heads, length, hd = cache.shape
    bsz = new.shape[0]
    batch_rows = torch.arange(bsz, device=cache.device) if slots is None else slots  # [B]
    heads_index = torch.arange(heads, device=cache.device)
    flat = (batch_rows[:, None, None] * heads + heads_index[None, :, None]) * length + positions[:, None, :]
    # flat: [B, KVH, T], each new row's index in the cache viewed as [N * KVH * S, hd]
    storage, values = cache, new.reshape(-1, hd)
    if cache.dtype == torch.float8_e4m3fn:
        storage, values = cache.view(torch.uint8), values.view(torch.uint8)
    storage.view(rows * heads * length, hd).index_copy_(0, flat.reshape(-1), values)


def attends_in_place(positions, slots) -> bool:
    """Whether Attention.forward's call is a decode step or a speculative check (slots None, or
    each token's [B, T]), rather than a prompt chunk (slots [B]) or a call without a cache."""
    return positions is not None and (slots is None or slots.dim() == 2)


def batch_rows(slots):
    """The cache row of each batch row ([B], or None: row b) from Attention.forward's `slots`,
    which may also give every token's ([B, T], one row's tokens all in one cache row)."""
    return slots[:, 0] if slots is not None and slots.dim() == 2 else slots


def read_cache(cache, slots, attended: int) -> torch.Tensor:
    """The first `attended` entries of cache rows `slots` ([B]; None: all rows, in order):
    [B, KVH, S', hd]."""
    held = cache[:, :, :attended]  # [N, KVH, S', hd]
    return held if slots is None else held.index_select(0, slots)


def softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention whose scores pass through cap * tanh(scores / cap) before the mask (Gemma 2),
    a step SDPA has no hook for. q: [B, KVH, G*T, hd]; k, v: [B, KVH, S, hd]; mask: [B, 1, G*T, S]."""
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, KVH, G*T, S]
    scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


def attention_with_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per query head, its sink, that weighs no value
    (gpt-oss). q: [B, KVH, G*T, hd], the G heads of a KV head folded into the query axis; k, v:
    [B, KVH, S, hd]; mask: [B, 1, G*T, S]; sinks: [H]. In fp32, as decode attention computes it."""
    bsz, kv_heads, rows, _ = q.shape
    group = sinks.shape[0] // kv_heads
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, KVH, G*T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, kv_heads, group, 1).repeat_interleave(rows // group, dim=2)  # [1, KVH, G*T, 1]
    probs = torch.cat([scores, sink.expand(bsz, -1, -1, -1)], dim=-1).softmax(-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul and act(gate) * up one op
    (qrt::act_mul)."""

    def __init__(self, cfg: ModelConfig, prefix: str, scheme, dtype, *, fused_checkpoint: bool,
                 intermediate_size: int | None = None):
        super().__init__()
        inter, tp = intermediate_size or cfg.intermediate_size, cfg.parallel
        part = tp.even(inter, f"{prefix}: intermediate_size")  # column-parallel gate/up, row-parallel down
        if fused_checkpoint:
            shards = dict(method=scheme.method_for(f"{prefix}.gate_up_proj"))
        else:
            shards = dict(shard_ids=(0, 1), method=scheme.method_for([f"{prefix}.gate_proj", f"{prefix}.up_proj"]))
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], bias=False, dtype=dtype, parallel=tp,
                                   n_slices=[part, part], **shards)
        self.down_proj = Linear(inter, [cfg.hidden_size], bias=False, dtype=dtype,
                                method=scheme.method_for(f"{prefix}.down_proj"), parallel=tp, k_slice=part)
        self.activation = cfg.hidden_act

    def forward(self, x):
        return self.down_proj(torch.ops.qrt.act_mul(self.gate_up_proj(x), self.activation))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)). Families change the class attributes."""

    norm_cls = RMSNorm
    fused_checkpoint = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    mlp_name = "mlp"  # the checkpoint's name of the feed-forward block (Mixtral: block_sparse_moe)
    attention_cls = Attention  # DeepSeek: multi-head latent attention (models/mla.py)

    def __init__(self, cfg: ModelConfig, index: int, scheme, dtype):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.sliding = cfg.layer_types[index] == SLIDING_ATTENTION  # the model picks its mask and RoPE by this
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(cfg, f"{prefix}.self_attn", scheme, dtype, norm_cls=self.norm_cls,
                                            fused_checkpoint=self.fused_checkpoint)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        setattr(self, self.mlp_name, self.make_mlp(cfg, index, f"{prefix}.{self.mlp_name}", scheme, dtype))
        if self.sliding:
            self.self_attn.sliding_window = cfg.sliding_window

    def make_mlp(self, cfg: ModelConfig, index: int, prefix: str, scheme, dtype) -> nn.Module:
        """The feed-forward block of layer `index` (mixture-of-experts families choose per layer)."""
        return GatedMLP(cfg, prefix, scheme, dtype, fused_checkpoint=self.fused_checkpoint)

    def forward(self, x, cos, sin, mask, positions, slots):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, positions, slots)
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))
