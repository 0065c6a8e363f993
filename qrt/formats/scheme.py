"""A QuantScheme: the quantization a model gets, answering per linear layer which LinearMethod
creates, loads and runs its weights. Layers are named by their checkpoint module names (a fused
layer by all of its shards'). Also what every format module reading a config needs: ignore-list
matching and reading a JSON side file. Which scheme a checkpoint gets is resolve.py's question.
"""

import fnmatch
import json
import re
from pathlib import Path

from qrt.errors import ConfigError, UnsupportedError
from qrt.layers.unquantized import UnquantizedLinearMethod


class QuantScheme:
    """name: "none", an online format, or a stored format; `make_method(module_names)`: the
    LinearMethod of a quantized layer; `skip`: module patterns kept dense."""

    def __init__(self, name: str, make_method=None, skip=(), description: str = "", kv_cache_fp8: str | None = None,
                 quantized_lm_head: bool = False, make_lm_head_method=None):
        self.name = name
        self.make_method = make_method
        self.skip = tuple(skip)
        self.description = description
        self.kv_cache_fp8 = kv_cache_fp8  # None, or the family that wrote the FP8 KV cache's scales
        self.quantized_lm_head = quantized_lm_head  # the checkpoint stores lm_head quantized too
        self.make_lm_head_method = make_lm_head_method  # online: lm_head's own format, or None (kept dense)

    def method_for(self, module_names):
        """The LinearMethod for a layer made of the checkpoint modules `module_names`."""
        if isinstance(module_names, str):
            module_names = [module_names]
        if self.make_lm_head_method is not None and module_names == ["lm_head"]:
            return self.make_lm_head_method()
        dense = ("embed_tokens",) if self.quantized_lm_head else ("lm_head", "embed_tokens")
        if self.make_method is None or any(n.endswith(dense) for n in module_names):
            return UnquantizedLinearMethod()
        skipped = {any(matches(name, pattern) for pattern in self.skip) for name in module_names}
        if len(skipped) > 1:
            raise UnsupportedError(f"the shards {module_names} are quantized differently (some are in the ignore "
                                   f"list, some not); qrt runs them as one fused layer and cannot mix them")
        return UnquantizedLinearMethod() if skipped.pop() else self.make_method(list(module_names))

    def describe(self) -> str:
        return self.description or self.name


def matches(name: str, pattern: str) -> bool:
    """Ignore-list matching: `re:` regexes (compressed-tensors), wildcards (ModelOpt), else a
    module name or a dotted suffix/prefix of one ("lm_head", "mlp.gate", "model.layers.0")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern.rstrip("*").rstrip("."))
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def read_json(path: Path) -> dict:
    """A JSON config file (config.json, a quantization side file) as a dict, or a ConfigError naming it."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
