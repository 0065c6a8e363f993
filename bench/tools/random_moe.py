"""A random-weight mixture-of-experts model sized for this machine: a Qwen3-MoE of 1.0B parameters
of which 0.23B are active per token (hidden 1024, 12 layers, 32 experts of intermediate 768, 6 per
token, 16 heads, 4 KV heads, vocab 32000, untied lm_head), as a bf16 safetensors checkpoint in the
hub's one-tensor-per-expert layout. Made on first use in the qrt cache (bench/moe-1b-random) and
reused afterwards; its outputs mean nothing.

    python -m bench.tools.random_moe          # make it (if absent) and print its folder

The router weights are random like the rest, so tokens spread over the experts about evenly: the
roofline of a batch counts the experts a batch of that size is expected to touch under uniform
routing (bench/roofline.py).
"""

from pathlib import Path

import torch

from bench.tools.random_llama import INIT_STD, SEED, cached_random_checkpoint, write_safetensors

MOE_1B = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    intermediate_size=2816,  # of dense layers; this model has none
    moe_intermediate_size=768,
    num_experts=32,
    num_experts_per_tok=6,
    norm_topk_prob=True,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
FOLDER = "moe-1b-random"
WRITER_VERSION = 1


def random_moe_path(progress: bool = True) -> Path:
    return cached_random_checkpoint(FOLDER, MOE_1B, write_random_moe, WRITER_VERSION,
                                    "a random-weight Qwen3-MoE (1.0B parameters, 0.23B active, bf16)"
                                    if progress else None)


def moe_names_shapes(shape: dict) -> dict:
    """Tensor name -> shape of a Qwen3-MoE checkpoint as the hub stores it."""
    d, heads, kv, hd = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    experts, inter = shape["num_experts"], shape["moe_intermediate_size"]
    names = {"model.embed_tokens.weight": (shape["vocab_size"], d)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        names.update({
            f"{layer}.input_layernorm.weight": (d,), f"{layer}.post_attention_layernorm.weight": (d,),
            f"{layer}.self_attn.q_proj.weight": (heads * hd, d), f"{layer}.self_attn.k_proj.weight": (kv * hd, d),
            f"{layer}.self_attn.v_proj.weight": (kv * hd, d), f"{layer}.self_attn.o_proj.weight": (d, heads * hd),
            f"{layer}.self_attn.q_norm.weight": (hd,), f"{layer}.self_attn.k_norm.weight": (hd,),
            f"{layer}.mlp.gate.weight": (experts, d),
        })
        for e in range(experts):
            expert = f"{layer}.mlp.experts.{e}"
            names.update({f"{expert}.gate_proj.weight": (inter, d), f"{expert}.up_proj.weight": (inter, d),
                          f"{expert}.down_proj.weight": (d, inter)})
    names["model.norm.weight"] = (d,)
    names["lm_head.weight"] = (shape["vocab_size"], d)
    return names


def write_random_moe(folder: Path, shape: dict) -> None:
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(**shape, dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"]).save_pretrained(folder)
    generator = torch.Generator().manual_seed(SEED)

    def tensor(name: str, size: tuple) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(size, dtype=torch.bfloat16)
        return torch.randn(size, generator=generator).mul_(INIT_STD).to(torch.bfloat16)

    write_safetensors(folder / "model.safetensors", moe_names_shapes(shape), tensor)


if __name__ == "__main__":
    print(random_moe_path())
