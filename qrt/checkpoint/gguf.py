"""GGUF (llama.cpp) files as a load format, read through transformers' GGUF support.

transformers dequantizes every GGUF type it knows and undoes llama.cpp's q/k row permutation;
its reader returns all tensors at once, so a GGUF load holds the dequantized weights beside the
model until each is consumed (memory peaks near twice the model, unlike safetensors loading).
"""

from pathlib import Path

import torch

from qrt.errors import CheckpointError, UnsupportedError

# transformers config class -> the HF architecture name qrt's registry knows it by.
_ARCHITECTURES = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM"}


def _config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as err:
        raise CheckpointError(path, None, f"cannot read the GGUF metadata ({err})") from None


def read_gguf_config(path: Path) -> dict:
    config = _config(path)
    arch = _ARCHITECTURES.get(type(config).__name__)
    if arch is None:
        raise UnsupportedError(f"{path}: GGUF of model type {config.model_type!r} is not supported; "
                               f"supported: {', '.join(sorted(_ARCHITECTURES.values()))}")
    hf_config = config.to_dict()
    hf_config["architectures"] = [arch]
    return hf_config


def read_gguf_tensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its Hugging Face name, dequantized to `dtype`."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are needed, not its memory
        names_model = AutoModelForCausalLM.from_config(_config(path))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names_model,
                                torch_dtype=dtype)["tensors"]


def read_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
