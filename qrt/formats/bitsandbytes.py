"""bitsandbytes checkpoints as transformers saves them with `BitsAndBytesConfig`
(`quant_method: "bitsandbytes"`): 4-bit NF4/FP4 (bitsandbytes_4bit.py) and 8-bit LLM.int8()
weights (bitsandbytes_8bit.py). This module reads the quantization config and registers the format.

Config keys read (docs/formats.md §14): `load_in_4bit` / `load_in_8bit` (transformers also writes
`_load_in_4bit` / `_load_in_8bit`), `bnb_4bit_quant_type` ("nf4" or "fp4"),
`bnb_4bit_use_double_quant`, `bnb_4bit_quant_storage` (only "uint8": the codes as bytes),
`llm_int8_has_fp16_weight` (only false: the weights are stored as int8) and `llm_int8_skip_modules`.
The block size is not in the config: each weight's quant_state records its own.

Which modules are quantized is read from the tensor names, where the checkpoint's files are at
hand: transformers converts only `nn.Linear` modules, so the experts that transformers 5 holds as
stacked parameters (Qwen3-MoE's, for one) are saved unquantized, while checkpoints written
before, with one `nn.Linear` per expert, quantized them. The config does not say which.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from qrt.errors import ConfigError, UnsupportedError
from qrt.formats.bitsandbytes_4bit import Bnb4bitLinearMethod
from qrt.formats.bitsandbytes_8bit import Bnb8bitLinearMethod
from qrt.formats.registry import stored_format
from qrt.formats.scheme import QuantScheme, matches
from qrt.layers.unquantized import UnquantizedLinearMethod

QUANT_TYPES = ("nf4", "fp4")


@dataclass(frozen=True)
class BnbConfig:
    bits: int  # 4 or 8
    quant_type: str | None  # 4-bit: "nf4" or "fp4"
    double_quant: bool  # 4-bit: absmax stored as 8-bit codes with a nested absmax
    source: str = "config.json"

    def describe(self) -> str:
        if self.bits == 8:
            return "bitsandbytes int8 (LLM.int8() rows, weight-only)"
        return f"bitsandbytes {self.quant_type.upper()}" + (" double quant" if self.double_quant else "")


def _flag(config: dict, name: str) -> bool:
    return bool(config.get(name, config.get(f"_{name}", False)))


def bnb_config(config: dict, source) -> BnbConfig:
    four, eight = _flag(config, "load_in_4bit"), _flag(config, "load_in_8bit")
    if four == eight:
        raise ConfigError(f"{source}: a bitsandbytes quantization_config sets exactly one of load_in_4bit and "
                          f"load_in_8bit; found load_in_4bit={four}, load_in_8bit={eight}")
    if eight:
        if config.get("llm_int8_has_fp16_weight"):
            raise UnsupportedError(f"{source}: bitsandbytes llm_int8_has_fp16_weight=true keeps float weights for "
                                   f"training; qrt loads the int8 weights of an inference checkpoint")
        return BnbConfig(8, None, False, str(source))
    quant_type = config.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in QUANT_TYPES:
        raise UnsupportedError(f"{source}: bnb_4bit_quant_type={quant_type!r} is not supported; supported: "
                               f"{list(QUANT_TYPES)}")
    storage = config.get("bnb_4bit_quant_storage", "uint8")
    if storage != "uint8":
        raise UnsupportedError(f"{source}: bnb_4bit_quant_storage={storage!r} is not supported; qrt reads the "
                               f"4-bit codes stored as uint8 (transformers' default)")
    return BnbConfig(4, quant_type, bool(config.get("bnb_4bit_use_double_quant", False)), str(source))


def skip_patterns(config: dict) -> list[str]:
    """`llm_int8_skip_modules` as qrt's ignore patterns. transformers skips a module when an entry
    matches its name from the start up to a module boundary (as a regex), or is a suffix of it."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    patterns = []
    for key in config.get("llm_int8_skip_modules") or ():
        patterns += [f"re:(?:{key}){boundary}", f"re:.*{re.escape(key)}$"]
    return patterns


# The tensor a quantized module has beside its weight: 4-bit's absmax, 8-bit's row scales.
QUANTIZED_MARKS = (".weight.absmax", ".SCB")


def quantized_modules(source) -> set[str] | None:
    """The modules whose tensors in the checkpoint next to `source` (its config.json) are
    quantized, from the safetensors headers or index; None where there are no files to read."""
    folder = Path(source).parent
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text()).get("weight_map", {})
    else:
        names = []
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                names += list(f.keys())
    if not names:
        return None
    return {name[: -len(mark)] for name in names for mark in QUANTIZED_MARKS if name.endswith(mark)}


def method_factory(cfg: BnbConfig, quantized: set[str] | None):
    """The LinearMethod of a layer by its checkpoint modules: bitsandbytes' where the files
    quantize them (all of them, where they were not read), dense where they do not."""
    method = Bnb8bitLinearMethod if cfg.bits == 8 else Bnb4bitLinearMethod

    def make(names):
        if quantized is None:
            return method(cfg, names)
        held = {name in quantized for name in names}
        if len(held) > 1:
            raise UnsupportedError(f"{cfg.source}: of the modules {names}, which qrt runs as one layer, only "
                                   f"{sorted(set(names) & quantized)} are quantized in the checkpoint")
        return method(cfg, names) if held.pop() else UnquantizedLinearMethod()

    return make


@stored_format("bitsandbytes", computes=("qrt.lut4_linear", "qrt.int_linear"),
               summary="bitsandbytes 4-bit NF4/FP4 (blocks of 64, double quant) and 8-bit "
               "(int8 rows), as transformers' BitsAndBytesConfig saves them")
def bnb_scheme(config: dict, source) -> QuantScheme:
    cfg = bnb_config(config, source)
    skip = skip_patterns(config)
    quantized = quantized_modules(source)
    if quantized is None:
        # transformers leaves the output layer unquantized unless the config lists the modules to
        # skip: that list replaces its default, so lm_head is quantized when the list leaves it out.
        quantized_lm_head = (config.get("llm_int8_skip_modules") is not None
                             and not any(matches("lm_head", p) for p in skip))
    else:
        quantized_lm_head = "lm_head" in quantized
    return QuantScheme("bitsandbytes", method_factory(cfg, quantized), skip, cfg.describe(),
                       quantized_lm_head=quantized_lm_head)
