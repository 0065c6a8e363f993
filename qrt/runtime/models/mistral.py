"""Mistral: Llama with a sliding attention window on every layer when the config sets one."""

from dataclasses import replace

from .config import ConfigReader, ModelConfig, uniform_sliding_window
from .decoder import CausalLM


class MistralForCausalLM(CausalLM):
    config_defaults = {"sliding_window": 4096}  # null in config.json turns the window off

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        hf = {**cls.config_defaults, **hf_config}
        cfg = ModelConfig.from_hf(hf, cls.__name__, source=source)
        return replace(cfg, **uniform_sliding_window(ConfigReader(hf, source), cfg.num_layers))
