"""The format registry: every quantization format qrt reads from a checkpoint or applies while
loading, registered by the module that implements it.

A format module registers, next to its LinearMethod:
- `@stored_format(quant_method, ...)`: how a `quantization_config` with that `quant_method` (in
  config.json, or in an older export's side file) becomes a QuantScheme;
- `@side_file(name, ...)`: a side file that marks a checkpoint as quantized when config.json says
  nothing (ModelOpt's hf_quant_config.json);
- `@compressed_tensors_format(name, matches=...)`: a compressed-tensors sub-format, chosen by the
  config group it matches;
- `@online_format(name, ...)`: a `quant=` value applied to an unquantized checkpoint.

Each names the logical ops its layers compute (`computes`, e.g. "qrt.lut4_linear"): the format
table lists the kernels declared for them on each device (kernels/choices.py).

This module imports no format: catalog.py imports every format module and reads the registries
it filled, so every list (the CLI's help, errors' "supported: ..." lists, `qrt formats`, the
contract test) is the registry's.
"""

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StoredFormat:
    quant_method: str  # quantization_config.quant_method, lower case
    read: Callable  # (quantization config dict, source path) -> QuantScheme
    summary: str  # one line for `qrt formats`, the README and errors
    # For the side files older GPTQ/AWQ exports carry (quantize_config.json, quant_config.json),
    # which may not say their quant_method: does this config look like one of this format's?
    claims_side_file: Callable | None = None
    detected_from: str = "`quantization_config.quant_method`"  # for the format table
    computes: tuple[str, ...] = ()  # the logical ops its layers call


@dataclass(frozen=True)
class SideFileFormat:
    file_name: str
    name: str  # the producer and format, e.g. "ModelOpt FP8"
    read: Callable  # (path) -> QuantScheme, or None when the file is not this format's
    summary: str
    computes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompressedTensorsGroup:
    """The one config group of a compressed-tensors config, as its sub-formats read it."""

    fmt: str | None  # the group's (or the config's) `format`
    weights: dict  # QuantizationArgs of the weights
    inputs: dict | None  # QuantizationArgs of the input activations, None when not quantized
    config: dict  # the whole quantization_config


@dataclass(frozen=True)
class CompressedTensorsFormat:
    name: str
    matches: Callable  # (CompressedTensorsGroup) -> bool; at most one sub-format matches a group
    read: Callable  # (CompressedTensorsGroup, skip patterns, source) -> QuantScheme
    summary: str
    computes: tuple[str, ...] = ()


@dataclass(frozen=True)
class OnlineFormat:
    name: str  # the quant= value
    make_method: Callable  # (checkpoint module names) -> LinearMethod
    summary: str
    # lm_head's own method, or None: lm_head stays as stored (so do the embeddings, always)
    make_lm_head_method: Callable | None = None
    lm_head_summary: str = ""
    computes: tuple[str, ...] = ()


# Side files older GPTQ and AWQ exports carry instead of a quantization_config in config.json; the
# stored format whose `claims_side_file` accepts the file reads it, unless it names its quant_method.
LEGACY_SIDE_FILES = ("quantize_config.json", "quant_config.json")

STORED: dict[str, StoredFormat] = {}
SIDE_FILES: dict[str, SideFileFormat] = {}
COMPRESSED_TENSORS: dict[str, CompressedTensorsFormat] = {}
ONLINE: dict[str, OnlineFormat] = {}


def _add(table: dict, key: str, entry) -> None:
    if key in table:
        raise ValueError(f"format {key!r} is registered twice")
    table[key] = entry


def stored_format(quant_method: str, *, summary: str, computes: tuple[str, ...],
                  claims_side_file: Callable | None = None, detected_from: str = StoredFormat.detected_from):
    def register(read):
        _add(STORED, quant_method, StoredFormat(quant_method, read, summary, claims_side_file, detected_from,
                                                computes))
        return read
    return register


def side_file(file_name: str, *, name: str, summary: str, computes: tuple[str, ...]):
    def register(read):
        _add(SIDE_FILES, file_name, SideFileFormat(file_name, name, read, summary, computes))
        return read
    return register


def compressed_tensors_format(name: str, *, summary: str, matches: Callable, computes: tuple[str, ...]):
    def register(read):
        _add(COMPRESSED_TENSORS, name, CompressedTensorsFormat(name, matches, read, summary, computes))
        return read
    return register


def online_format(name: str, *, summary: str, computes: tuple[str, ...], lm_head: Callable | None = None,
                  lm_head_summary: str = ""):
    def register(make_method):
        _add(ONLINE, name, OnlineFormat(name, make_method, summary, lm_head, lm_head_summary, computes))
        return make_method
    return register
