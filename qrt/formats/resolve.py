"""Which quantization a model gets: detected from the checkpoint (its `quantization_config`, or a
side file), or asked for with `quant=`. What each format is and how it is detected lives with the
format, registered in registry.py; this module only resolves a checkpoint and a `quant=` argument
to a QuantScheme.
"""

from pathlib import Path

from qrt.errors import ConfigError, UnsupportedError

from .catalog import online_formats, side_file_formats, stored_formats
from .registry import LEGACY_SIDE_FILES
from .scheme import QuantScheme, read_json


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
