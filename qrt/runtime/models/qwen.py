"""Qwen2 (Llama with q/k/v bias) and Qwen3 (RMSNorm over each q/k head instead of the bias)."""

from dataclasses import replace

from qrt.errors import UnsupportedError

from .config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig
from .decoder import CausalLM


def qwen_sliding_window(read: ConfigReader, num_layers: int) -> dict:
    """Qwen configs carry a `sliding_window` that applies only with `use_sliding_window`, and
    then to the layers from `max_window_layers` on (or as `layer_types` says)."""
    if not read.boolean("use_sliding_window", False):
        return {}
    start = read.integer("max_window_layers", 28, minimum=0)
    default = [SLIDING_ATTENTION if i >= start else FULL_ATTENTION for i in range(num_layers)]
    return {"sliding_window": read.positive_int("sliding_window", 4096),
            "layer_types": read.layer_types(num_layers, default)}


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        cfg = super().read_config(hf_config, source)
        return replace(cfg, qkv_bias=True, **qwen_sliding_window(ConfigReader(hf_config, source), cfg.num_layers))


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        read = ConfigReader(hf_config, source)
        if read.boolean("attention_bias", False):
            raise UnsupportedError(f"{source}: attention_bias=true; {cls.__name__} is supported without biases only")
        cfg = super().read_config(hf_config, source)
        return replace(cfg, qk_norm=True, **qwen_sliding_window(read, cfg.num_layers))
