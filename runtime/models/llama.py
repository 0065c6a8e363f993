"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama) and Qwen2 (the same with q/k/v bias)."""

import torch
from torch import nn

from loaders.kv_cache import KV_SCALE_RENAMES

from .config import ModelConfig
from .layers import DecoderLayer, Embedding, Linear, RMSNorm, rope_tables


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, scheme, dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, f"model.layers.{i}", scheme, dtype) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    # (fused parameter, checkpoint shard name, shard id): checkpoints store q/k/v and gate/up
    # separately; qrt runs each group as one matmul.
    stacked_params = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
    # Checkpoint names that other exporters give tensors qrt loads under another name.
    renamed_tensors = KV_SCALE_RENAMES
    # Checkpoint tensors that carry nothing qrt needs (derived buffers some exporters save).
    ignored_tensor_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, hf_config: dict, scheme, dtype, source="config.json"):
        super().__init__()
        arch = type(self).__name__
        self.config = cfg = ModelConfig.from_hf(hf_config, arch, qkv_bias=self.qkv_bias, source=source)
        self.dtype = dtype
        self.model = DecoderModel(cfg, scheme, dtype)
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], bias=False, dtype=dtype,
                              method=scheme.method_for("lm_head"))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_seq_len = 0

    def tied_tensor_names(self) -> tuple:
        """Checkpoint tensors that alias another one in this model and may be skipped."""
        return ("lm_head.weight",) if self.config.tie_word_embeddings else ()

    def allocate_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Rotary tables and the static KV cache; called once the weights are materialized."""
        device = self.model.embed_tokens.weight.device
        cos, sin = rope_tables(self.config, max_seq_len, self.dtype, device)  # [S, hd] each
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for layer in self.model.layers:
            layer.self_attn.allocate_cache(max_batch_size, max_seq_len, self.dtype, device)
        self.max_seq_len = max_seq_len

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids: [B, T] int64. With input_pos ([T] positions) K/V go to the static cache
        and attention covers everything cached so far; without it, plain causal attention
        within input_ids (no cache). Returns float32 logits [B, T, V] ([B, 1, V] if last_only)."""
        seq = input_ids.shape[1]
        if input_pos is None:
            positions = torch.arange(seq, device=input_ids.device)
            mask = positions[None, :] <= positions[:, None]  # [T, T] causal
        else:
            positions = input_pos
            keys = torch.arange(self.max_seq_len, device=input_ids.device)
            mask = keys[None, :] <= input_pos[:, None]  # [T, S]: each query sees cached past
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, hd]
        x = self.model.embed_tokens(input_ids)  # [B, T, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, input_pos)
        x = self.model.norm(x)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(x).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
