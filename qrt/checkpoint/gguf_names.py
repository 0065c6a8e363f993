"""GGUF tensor names -> Hugging Face names, by transformers' map for the architecture."""

import contextlib
import functools

import torch


def hf_names(config, processor) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for a model of transformers `config`; `processor` is
    transformers' tensor processor for the architecture (it renames some tensors first)."""
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
