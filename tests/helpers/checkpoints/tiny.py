"""Tiny random Hugging Face checkpoints, made with transformers' own classes and saved as
safetensors, so qrt is checked against the real file layout and the real reference model."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def make_checkpoint(folder: Path, arch: str = "llama", *, dtype=torch.float32, seed: int = 0,
                    tie: bool = False, **overrides):
    """Write a tiny random `arch` ("llama" | "qwen2" | "qwen3") checkpoint into `folder`; return the HF model."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_cls(**{**TINY, "tie_word_embeddings": tie, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # transformers initialises norms to 1 and biases to 0; random values catch a missed load.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def random_ids(seed: int = 0, shape: tuple[int, ...] = (2, 16)) -> torch.Tensor:
    """Token ids drawn uniformly from the tiny models' vocabulary, the same for the same seed."""
    return torch.randint(0, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def edited_copy(folder: Path, copy: Path, *, config=None, tensors=None) -> Path:
    """A copy of checkpoint `folder` at `copy`: `config(quantization_config)` edits its config.json's
    quantization_config in place and `tensors(state)` its model.safetensors (a name -> tensor dict)."""
    shutil.copytree(folder, copy)
    if config is not None:
        hf_config = json.loads((copy / "config.json").read_text())
        config(hf_config["quantization_config"])
        (copy / "config.json").write_text(json.dumps(hf_config))
    if tensors is not None:
        state = load_file(str(copy / "model.safetensors"))
        tensors(state)
        save_file(state, str(copy / "model.safetensors"))
    return copy
