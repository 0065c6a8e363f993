"""A small random-weight gpt-oss (GptOssForCausalLM: attention sinks, alternating sliding-window and
full layers, YaRN, experts with biases and the clamped SwiGLU), written by transformers in bf16 on
first use into qrt's cache (bench/gpt-oss-random), for `bench.suite --model gpt-oss`. 4 layers,
hidden 512, 16 experts of 512 of which 4 a token, a window of 128, vocab 32000: about 0.1B
parameters. Its outputs mean nothing.

    python -m bench.tools.random_gpt_oss        # make it (if absent) and print its folder
"""

import sys
from pathlib import Path

import torch

from bench.tools.random_llama import SEED, cached_random_checkpoint

GPT_OSS_SMALL = dict(
    hidden_size=512,
    num_hidden_layers=4,
    intermediate_size=512,
    num_local_experts=16,
    num_experts_per_tok=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 2,
    vocab_size=32000,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
)
FOLDER = "gpt-oss-random"
WRITER_VERSION = 1


def random_gpt_oss_path(progress: bool = True) -> Path:
    return cached_random_checkpoint(FOLDER, GPT_OSS_SMALL, write_random_gpt_oss, WRITER_VERSION,
                                    "a random-weight gpt-oss (0.1B parameters, bf16)" if progress else None)


def write_random_gpt_oss(folder: Path, shape: dict) -> None:
    """transformers' own initialization (small enough to build whole), saved in bf16."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(SEED)
    model = GptOssForCausalLM(GptOssConfig(**shape, architectures=["GptOssForCausalLM"]))
    model.to(torch.bfloat16).save_pretrained(str(folder), safe_serialization=True)


if __name__ == "__main__":
    print(random_gpt_oss_path())
    sys.exit(0)
