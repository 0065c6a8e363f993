"""Phi-3 (and Phi-4-mini): Llama whose checkpoint stores q/k/v and gate/up fused, with LongRoPE
scaling, partial rotary embeddings and an optional sliding window on every layer."""

from dataclasses import replace

from .config import ConfigReader, ModelConfig, uniform_sliding_window
from .decoder import CausalLM
from .layers import DecoderLayer


class Phi3DecoderLayer(DecoderLayer):
    fused_checkpoint = True


class Phi3ForCausalLM(CausalLM):
    layer_cls = Phi3DecoderLayer
    checkpoint_layout = replace(CausalLM.checkpoint_layout, stacked=())  # qkv_proj and gate_up_proj load whole
    config_defaults = {"original_max_position_embeddings": 4096}

    @classmethod
    def read_config(cls, hf_config, source) -> ModelConfig:
        hf = {**cls.config_defaults, **hf_config}
        for key in ("rope_scaling", "rope_parameters"):
            # Phi-3 configs written before `longrope` had a name call it "su" (or "yarn").
            params = hf.get(key)
            if isinstance(params, dict) and params.get("rope_type", params.get("type")) in ("su", "yarn"):
                hf[key] = {**params, "rope_type": "longrope"}
        cfg = ModelConfig.from_hf(hf, cls.__name__, source=source, partial_rotary=True)
        return replace(cfg, **uniform_sliding_window(ConfigReader(hf, source), cfg.num_layers))
