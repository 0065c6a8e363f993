"""GGUF tensor names -> Hugging Face names, by transformers' map for the architecture, kept in
qrt's cache.

transformers' map walks a model of the architecture (built on the meta device) and asks gguf-py's
name table for each parameter. Building that model imports transformers' modeling code: about
40 MiB resident and a few tenths of a second, at every load, for a map that depends only on the
config and the library versions. So the map is built once per (config, tensor processor,
transformers, gguf-py) and kept as JSON; a load that finds it imports no modeling code.
"""

import contextlib
import functools
import hashlib
import json
from pathlib import Path

import torch

from qrt.cache_dir import cache_root, write_cache_file


def hf_names(config, processor) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for a model of transformers `config`; `processor` is
    transformers' tensor processor for the architecture (it renames some tensors first)."""
    record = _record(config, processor)
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        pass  # not built yet, or damaged: built again
    names = _built(config, processor)
    write_cache_file(record, json.dumps(names))
    return names


def _record(config, processor) -> Path:
    from importlib.metadata import version

    identity = json.dumps([config.to_json_string(use_diff=False), type(processor).__qualname__,
                           version("transformers"), version("gguf")])
    return cache_root() / "gguf-names" / f"{hashlib.sha256(identity.encode()).hexdigest()[:24]}.json"


def _built(config, processor) -> dict[str, str]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):  # only its parameter names are needed, not its memory
        names_model = AutoModelForCausalLM.from_config(config)
    with _name_tables_built_once():
        return get_gguf_hf_weights_map(names_model, processor)


@contextlib.contextmanager
def _name_tables_built_once():
    """transformers' map walks every submodule of the model and builds gguf-py's name table for the
    architecture afresh in each (about 400 times for a 30-layer model, 13 ms apiece): built once
    here instead. The table depends only on its arguments, so the results are the same."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original
