"""Gemma 2 and Gemma 3 text models: Llama's blocks with (1 + w) RMSNorms around both the input
and the output of attention and MLP, embeddings scaled by sqrt(hidden_size), a query scale set
by `query_pre_attn_scalar`, optional tanh soft-capping of attention scores and logits, and
sliding-window layers interleaved with global ones. Gemma 3 adds RMSNorm over each q/k head and
gives its sliding layers their own RoPE base."""

from dataclasses import replace

import torch

from qrt.errors import UnsupportedError
from qrt.layers.tensor_parallel import SINGLE

from .config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig, Rope
from .decoder import CausalLM
from .layers import DecoderLayer, RMSNorm


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in fp32: Gemma checkpoints store the offset from one."""

    unit_offset = True


class GemmaDecoderLayer(DecoderLayer):
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, index: int, scheme, dtype):
        super().__init__(cfg, index, scheme, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, mask, positions, slots):
        # post_attention_layernorm normalises the attention output here, not the MLP input.
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, positions, slots))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(CausalLM):
    layer_cls = GemmaDecoderLayer
    config_defaults = {
        "tie_word_embeddings": True, "head_dim": 256,
        "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    }

    @classmethod
    def sliding_pattern(cls, read: ConfigReader) -> int:
        """Without `layer_types`, every n-th layer is global and the others slide."""
        return 2

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        read = ConfigReader({**cls.config_defaults, **hf_config}, source)
        for key in ("attention_bias", "use_bidirectional_attention"):
            if read.boolean(key, False):
                raise UnsupportedError(f"{source}: {key}=true is not supported for {cls.__name__}")
        cfg = super().read_config(hf_config, source)
        pattern = cls.sliding_pattern(read)
        default_types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(cfg.num_layers)]
        return replace(
            cfg,
            hidden_act=read.activation("hidden_activation", "gelu_pytorch_tanh"),
            attention_scale=read.positive_float("query_pre_attn_scalar") ** -0.5,
            attn_logit_softcap=read.optional_positive_float("attn_logit_softcapping"),
            final_logit_softcap=read.optional_positive_float("final_logit_softcapping"),
            sliding_window=read.optional_positive_int("sliding_window"),
            layer_types=read.layer_types(cfg.num_layers, default_types),
        )

    def __init__(self, hf_config: dict, scheme, dtype, source="config.json", parallel=SINGLE):
        super().__init__(hf_config, scheme, dtype, source, parallel)
        # transformers multiplies by sqrt(hidden_size) rounded to the model dtype.
        self.embed_scale = float(torch.tensor(self.config.hidden_size ** 0.5, dtype=dtype, device="cpu"))
        self.final_logit_softcap = self.config.final_logit_softcap

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embed_scale  # [B, T, D]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)  # [B, T, V]
        if self.final_logit_softcap is not None:
            logits = self.final_logit_softcap * torch.tanh(logits / self.final_logit_softcap)
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    config_defaults = {
        **Gemma2ForCausalLM.config_defaults, "max_position_embeddings": 131072, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,
    }

    @classmethod
    def sliding_pattern(cls, read: ConfigReader) -> int:
        return read.positive_int("sliding_window_pattern")

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        cfg = super().read_config(hf_config, source)
        local_rope = cfg.local_rope
        if local_rope is None:  # configs older than per-layer-type rope_parameters
            theta = ConfigReader({**cls.config_defaults, **hf_config}, source).positive_float("rope_local_base_freq")
            local_rope = Rope(theta, cfg.head_dim)
        return replace(cfg, qk_norm=True, local_rope=local_rope)
