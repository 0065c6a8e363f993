"""Qwen2-MoE (q/k/v bias, a shared expert scaled by its own sigmoid gate) and Qwen3-MoE (RMSNorm
over each q/k head, `norm_topk_prob`): Qwen's attention with sparse blocks on the layers that
`decoder_sparse_step` and `mlp_only_layers` select (models/moe.py)."""

from dataclasses import replace

from qrt.errors import UnsupportedError

from .config import ConfigReader, ModelConfig
from .decoder import CausalLM
from .moe import MoEDecoderLayer, qwen_moe_config


def _read(cls, hf_config: dict, source) -> tuple[ModelConfig, ConfigReader]:
    read = ConfigReader(hf_config, source)
    if read.boolean("use_sliding_window", False):
        raise UnsupportedError(f"{source}: use_sliding_window=true is not supported for {cls.__name__}")
    cfg = ModelConfig.from_hf(hf_config, cls.__name__, source=source)
    return replace(cfg, moe=qwen_moe_config(read, cfg.num_layers)), read


class Qwen2MoeForCausalLM(CausalLM):
    layer_cls = MoEDecoderLayer

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        cfg, read = _read(cls, hf_config, source)
        moe = replace(cfg.moe, shared_expert_gate=cfg.moe.shared_expert_intermediate_size > 0)
        return replace(cfg, moe=moe, qkv_bias=read.boolean("qkv_bias", True))


class Qwen3MoeForCausalLM(CausalLM):
    layer_cls = MoEDecoderLayer

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        cfg, read = _read(cls, hf_config, source)
        if read.boolean("attention_bias", False):
            raise UnsupportedError(f"{source}: attention_bias=true; {cls.__name__} is supported without biases only")
        return replace(cfg, qk_norm=True)
