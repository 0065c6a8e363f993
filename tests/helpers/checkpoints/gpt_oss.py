"""A tiny random gpt-oss, written by transformers' own `GptOssForCausalLM`, and the same model with
its experts in MXFP4 as gpt-oss ships them (`quant_method: "mxfp4"`, the experts'
`*_blocks` / `*_scales`).

The sliding window (8) and YaRN's original context (32) are shorter than the tests' sequences,
so both take effect. Routers are scaled up so that each token's expert choice is decisive: a
near-tie would flip with any rounding and make two correct models disagree."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.checkpoints.tiny import TINY

ROUTER_SCALE = 8.0
SLIDING_WINDOW = 8
GPT_OSS = dict(
    TINY, intermediate_size=64, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"], initializer_range=0.1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
)
# What gpt-oss's own config.json leaves unquantized.
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def random_gpt_oss(seed: int = 0, **overrides):
    """A tiny random float32 transformers GptOssForCausalLM, its experts run by transformers' eager
    loop (the reference arithmetic), norms, biases and sinks random."""
    import transformers

    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + 1.0)
            elif name.endswith("bias") or name.endswith("sinks"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif name.endswith("router.weight"):
                param.mul_(ROUTER_SCALE)
    model.set_experts_implementation("eager")
    return model


def make_gpt_oss_checkpoint(folder: Path, *, dtype=torch.float32, seed: int = 0, **overrides):
    """Write a tiny random gpt-oss in `dtype` (dense experts, as transformers saves them); return the
    float32 transformers model."""
    model = random_gpt_oss(seed, **overrides)
    model.to(dtype).save_pretrained(str(folder), safe_serialization=True)
    return model.float()


def load_reference(folder: Path, dtype=torch.float32):
    """transformers' own GptOssForCausalLM read from `folder` in `dtype` (an MXFP4 checkpoint
    dequantized by transformers), with its eager experts loop."""
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.set_experts_implementation("eager")
    return model.eval()
