"""Tiny random checkpoints of the architectures beyond Llama/Qwen2, made with transformers' own
config and model classes and saved as sharded safetensors (`model.safetensors.index.json`).

Each config switches on what sets its family apart, at sizes where it shows: sliding windows
shorter than the test sequences, RoPE scalings whose original context (32) the tests cross,
soft-caps small enough to bend the scores, head_dim unequal to hidden / heads."""

from pathlib import Path

import torch

from helpers.checkpoints.tiny import TINY

SLIDING, FULL = "sliding_attention", "full_attention"
_GEMMA = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8)

ARCHS = {
    # name: (transformers config class, model class, config overrides)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                      "rope_theta": 10000.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=16, original_max_position_embeddings=32, pad_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.0, 2.0, 4.0, 8.0]})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _GEMMA, layer_types=[SLIDING, FULL],
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})),
}


def make_arch_checkpoint(folder: Path, arch: str, *, seed: int = 0, shard_size: str = "40KB"):
    """Write a tiny random `arch` checkpoint in shards of at most `shard_size`; return the
    float32 transformers model it holds."""
    import transformers

    config_name, model_name, overrides = ARCHS[arch]
    # Weights at 0.1 rather than 0.02 make attention scores and logits large enough that
    # soft-capping, RoPE scaling and masks change the result.
    config = getattr(transformers, config_name)(**{**TINY, "initializer_range": 0.1, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    # transformers initialises norms to one (Gemma: to zero, stored as the offset from one);
    # random values catch a norm that is not loaded or not applied.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + (0.0 if arch.startswith("gemma") else 1.0))
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size=shard_size)
    return model
