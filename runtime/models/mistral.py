"""Mistral: Llama with a sliding attention window on every layer when the config sets one."""

from dataclasses import replace

from .config import ConfigReader, ModelConfig, uniform_sliding_window
from .decoder import CausalLM


class MistralForCausalLM(CausalLM):
    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        cfg = super().read_config(hf_config, source)
        return replace(cfg, **uniform_sliding_window(ConfigReader(hf_config, source), cfg.num_layers))
