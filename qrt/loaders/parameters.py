"""The one way qrt makes parameters: plain `nn.Parameter`s carrying an attribute dict.

Parameter subclasses break `torch.compile` (Dynamo cannot trace them, which is why other runtimes
convert theirs back to plain Parameters before compiling), so loader metadata lives as ordinary
attributes on a plain Parameter: read at load time and by passes, never in `forward`.
"""

import torch
from torch import nn

# Attribute names a parameter may carry. Keeping them in one place catches typos at creation.
KNOWN_ATTRIBUTES = frozenset(
    {
        "weight_loader",  # callable(param, loaded_tensor, shard_id) that writes into param
        "input_dim",  # dim of the param that runs along the layer's input features (K)
        "output_dim",  # dim that runs along the output features (N)
        "packed_dim",  # dim holding packed sub-byte values, if any
        "packed_factor",  # values per stored element along packed_dim
        "quant_format",  # e.g. "fp8", "bf16"
        "storage_layout",  # storage layout after the loader pass, e.g. "fp8_e4m3 [N, K]"
        "kernel",  # kernel the layout was made for, set by the loader pass
        "optional",  # loaded when the checkpoint has it; the format's loader pass decides if it must
        "loaded_shape",  # shape of the tensor the weight_loader takes, when not the parameter's own
    }
)


def make_parameter(data: torch.Tensor, **attributes) -> nn.Parameter:
    """A frozen plain Parameter with the given attributes set on it."""
    unknown = set(attributes) - KNOWN_ATTRIBUTES
    if unknown:
        raise TypeError(f"unknown parameter attribute(s): {sorted(unknown)}")
    param = nn.Parameter(data, requires_grad=False)
    set_attributes(param, **attributes)
    return param


def set_attributes(param: nn.Parameter, **attributes) -> None:
    for name, value in attributes.items():
        setattr(param, name, value)


def attributes_of(param: nn.Parameter) -> dict:
    """The qrt attributes a parameter carries (for inspect and dump)."""
    return {name: getattr(param, name) for name in KNOWN_ATTRIBUTES if hasattr(param, name)}


def replace_parameter(module: nn.Module, name: str, data: torch.Tensor, **attributes) -> nn.Parameter:
    """Swap `module.<name>` for a new plain Parameter holding `data`, keeping its attributes.

    Used by the loader pass when a layout changes dtype or shape, which an in-place copy cannot.
    """
    old = getattr(module, name)
    kept = attributes_of(old)
    kept.update(attributes)
    new = make_parameter(data, **kept)
    setattr(module, name, new)
    return new
