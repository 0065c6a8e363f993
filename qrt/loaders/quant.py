"""Which quantization a model gets: detected from the checkpoint, or asked for with `quant=`.

A QuantScheme answers, per linear layer, which LinearMethod creates, loads and runs its weights.
Layers are named by their checkpoint module names (a fused layer by all of its shards'). What
each format is and how it is detected lives with the format, in the registry (registry.py); this
module only resolves a checkpoint and a `quant=` argument to a scheme, and matches ignore lists.
"""

import fnmatch
import json
import re
from pathlib import Path

from .errors import ConfigError, UnsupportedError
from .registry import LEGACY_SIDE_FILES, online_formats, side_file_formats, stored_formats
from .unquantized import UnquantizedLinearMethod

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


def resolve_scheme(hf_config: dict, quant: str | None, config_path, folder=None) -> QuantScheme:
    """The scheme for this checkpoint and `quant=` argument, or a clear error."""
    stored = detect_stored_scheme(hf_config, config_path, folder)
    if stored is not None:
        if quant not in (None, "none", stored.name):
            raise UnsupportedError(
                f"quant={quant!r} was asked for, but {config_path} is a pre-quantized {stored.describe()} "
                f"checkpoint; load it as stored (quant=None or quant={stored.name!r}) or start from an "
                f"unquantized checkpoint"
            )
        return stored
    if quant is None or quant == "none":
        return QuantScheme("none", description="none (weights as stored)")
    online = online_formats()
    if quant not in online:
        raise UnsupportedError(f"quant={quant!r} is not supported; choose None (as stored) or one of {sorted(online)}")
    fmt = online[quant]
    kept = f"{fmt.lm_head_summary}, embeddings kept" if fmt.make_lm_head_method else "lm_head and embeddings kept"
    return QuantScheme(quant, fmt.make_method, description=f"{quant} (online: {fmt.summary}; quantized while loading; "
                                                           f"{kept})",
                       make_lm_head_method=fmt.make_lm_head_method)


def detect_stored_scheme(hf_config: dict, config_path, folder=None) -> QuantScheme | None:
    stored = hf_config.get("quantization_config")
    if stored is None and folder is not None:
        return _side_file_scheme(Path(folder))
    if stored is None:
        return None
    if not isinstance(stored, dict) or "quant_method" not in stored:
        raise ConfigError(f"{config_path}: quantization_config has no 'quant_method'")
    return read_quant_config(stored, str(stored["quant_method"]).lower(), config_path)


def read_quant_config(config: dict, method: str, source) -> QuantScheme:
    """The scheme of a `quantization_config` (or an equivalent side file) whose quant_method is `method`."""
    formats = stored_formats()
    if method not in formats:
        raise UnsupportedError(
            f"{source}: the checkpoint is pre-quantized with quant_method={method!r}, which this version "
            f"of qrt cannot load yet; supported: {sorted(formats)}, and unquantized checkpoints"
        )
    return formats[method].read(config, source)


def _side_file_scheme(folder: Path) -> QuantScheme | None:
    for name, fmt in side_file_formats().items():
        path = folder / name
        scheme = fmt.read(path) if path.is_file() else None
        if scheme is not None:
            return scheme
    for name in LEGACY_SIDE_FILES:
        path = folder / name
        if path.is_file():
            config = read_json(path)
            return read_quant_config(config, _legacy_quant_method(config, path), path)
    return None


def _legacy_quant_method(config: dict, path: Path) -> str:
    if "quant_method" in config:
        return str(config["quant_method"]).lower()
    claimed = [fmt.quant_method for fmt in stored_formats().values()
               if fmt.claims_side_file is not None and fmt.claims_side_file(config)]
    if len(claimed) != 1:
        raise ConfigError(f"{path}: no quant_method, and the keys {sorted(config)} do not tell which format this is "
                          f"({'several fit: ' + ', '.join(claimed) if claimed else 'none fits'})")
    return claimed[0]


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value
