"""A GGUF file's transformers config, built from the metadata qrt's reader parsed (gguf_reader.py)
rather than by `AutoConfig.from_pretrained(folder, gguf_file=...)`, which parses the whole file
again with gguf-py's reader (seconds and ~200 MiB for a 49k-token vocabulary).

The config dict is made as transformers' `load_gguf_checkpoint` makes it, from transformers' own
tables at run time (GGUF_TO_TRANSFORMERS_MAPPING's key renames, GGUF_CONFIG_DEFAULTS_MAPPING), and
then the config object as AutoConfig makes it. Architectures transformers reads another way (its
newer GGUF path, GGUF_CONFIG_ARCHS; T5; gpt-oss's rope scaling; the ones it post-processes beyond
a rename) and files whose config keys qrt cannot map go to AutoConfig itself: this only ever saves
time, it never gives another config.
"""

from pathlib import Path

import numpy as np

from qrt.checkpoint.gguf_reader import GgufHeader, StringArray

# llama.cpp architecture names transformers knows by another model type (by substring, as it matches them).
_RENAMES = (("qwen2moe", "qwen2_moe"), ("qwen3moe", "qwen3_moe"))
# Architectures whose config transformers' legacy reader builds from more than key renames.
_LEGACY_ONLY = ("t5", "gpt_oss", "gpt-oss", "minimax-m2", "lfm2", "gemma4")
# Model types whose GGUF holds only the text model of a multimodal one.
_TEXT_ONLY = {"gemma3": "gemma3_text"}
# Architectures whose output layer transformers takes as tied whatever the tensors say.
_ALWAYS_TIED = ("falcon", "bloom")


def _tables():
    """transformers' GGUF tables: (config key renames by prefix, config defaults, supported
    architectures), or None where this transformers lacks one (AutoConfig then reads the file)."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING
    except ImportError:
        return None
    return GGUF_TO_TRANSFORMERS_MAPPING["config"], GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_SUPPORTED_ARCHITECTURES


def _newer_path_archs() -> frozenset:
    """The architectures transformers builds from its newer GGUF reader (none before 5.x)."""
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:
        return frozenset()
    return frozenset(GGUF_CONFIG_ARCHS)


def _model_type(architecture: str, name) -> str:
    """The model type transformers gives a llama.cpp architecture: llama.cpp writes Mistral as
    llama (told apart by a general.name of exactly "mistral", as transformers tells it)."""
    names = name if isinstance(name, list) else [] if name is None else [name]
    updated = "mistral" if "llama" in architecture and "mistral" in names else architecture
    for llama_cpp, model_type in _RENAMES:
        if llama_cpp in architecture:
            updated = model_type
    return updated


def _as_config_value(value, architecture: str, model_type: str):
    """A metadata value as transformers' legacy reader hands it to the config: arrays as lists
    (one element: the element itself), the architecture's name in strings replaced by the model
    type's. None where it is an undecoded array of strings."""
    if isinstance(value, StringArray):
        return None
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str) and architecture in value:
        value = value.replace(architecture, model_type)
    return value


def _structure_keys(header: GgufHeader) -> dict:
    """Config keys transformers reads off the tensor table: a tied output layer where there is no
    `output.weight`, and StableLM's bias and residual layout."""
    architecture = header.metadata["general.architecture"]
    names = [t.name for t in header.tensors]
    keys = {"tie_word_embeddings": "output.weight" not in names or architecture in _ALWAYS_TIED}
    if "stablelm" in architecture:
        keys["use_qkv_bias"] = any(bias in n for n in names for bias in ("attn_q.bias", "attn_k.bias", "attn_v.bias"))
        keys["use_parallel_residual"] = not any("ffn_norm" in n for n in names)
    return keys


def gguf_config_dict(header: GgufHeader) -> dict | None:
    """The config dict transformers' legacy GGUF reader makes of this header, or None where
    transformers reads it another way or a config key holds what qrt does not map."""
    tables = _tables()
    architecture = header.metadata.get("general.architecture")
    if (tables is None or not isinstance(architecture, str) or architecture in _newer_path_archs()
            or any(word in architecture for word in _LEGACY_ONLY)):
        return None
    renames, defaults, supported = tables
    model_type = _model_type(architecture, header.metadata.get("general.name"))
    if architecture not in supported and model_type not in supported:
        return None  # AutoConfig says which architectures it reads
    config = _structure_keys(header)
    for key, value in defaults.get(model_type, defaults.get(architecture) or {}).items():
        config.setdefault(key, value)
    for key, value in header.metadata.items():
        prefix, _, rest = key.replace(architecture, model_type).partition(".")
        renamed = renames.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        config[renamed] = _as_config_value(value, architecture, model_type)
        if config[renamed] is None:
            return None
    config["model_type"] = _TEXT_ONLY.get(config.get("model_type"), config.get("model_type"))
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.metadata:
        config["vocab_size"] = len(header.metadata["tokenizer.ggml.tokens"])
    return config


def gguf_config(header: GgufHeader):
    """The transformers config of the GGUF file, equal to AutoConfig.from_pretrained(folder,
    gguf_file=name)'s: made from `gguf_config_dict` where it maps the file, else by AutoConfig."""
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(header.path)
    config_dict = gguf_config_dict(header)
    if config_dict is None or config_dict.get("model_type") not in CONFIG_MAPPING:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    # As AutoConfig.from_pretrained hands the dict over: the folder it was given as name_or_path.
    return CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict, name_or_path=str(path.parent))
