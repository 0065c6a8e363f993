"""Which quantization a model gets: detected from the checkpoint, or asked for with `quant=`.

A QuantScheme answers, per linear layer, which LinearMethod creates, loads and runs its weights.
"""

from dataclasses import dataclass, field

from .errors import ConfigError, UnsupportedError
from .fp8 import Fp8OnlineLinearMethod
from .unquantized import UnquantizedLinearMethod

# quant= values qrt applies to an unquantized checkpoint while loading it.
ONLINE_METHODS = {"fp8": Fp8OnlineLinearMethod}


@dataclass
class QuantScheme:
    """name: "none" or a format; skip: module-name suffixes kept unquantized."""

    name: str
    skip: tuple = field(default=("lm_head", "embed_tokens"))

    def method_for(self, module_name: str):
        if self.name == "none" or module_name.endswith(self.skip):
            return UnquantizedLinearMethod()
        return ONLINE_METHODS[self.name]()

    def describe(self) -> str:
        if self.name == "none":
            return "none (weights as stored)"
        return f"{self.name} (online: quantized while loading; lm_head and embeddings kept)"


def resolve_scheme(hf_config: dict, quant: str | None, config_path) -> QuantScheme:
    """The scheme for this checkpoint and `quant=` argument, or a clear error."""
    stored = hf_config.get("quantization_config")
    if stored is not None:
        if not isinstance(stored, dict) or "quant_method" not in stored:
            raise ConfigError(f"{config_path}: quantization_config has no 'quant_method'")
        method = stored["quant_method"]
        raise UnsupportedError(
            f"{config_path}: the checkpoint is pre-quantized with quant_method={method!r}, which "
            f"this version of qrt cannot load yet. Unquantized checkpoints (bf16/fp16/fp32) are "
            f"supported, with quant=None or quant in {sorted(ONLINE_METHODS)}."
        )
    if quant is None or quant == "none":
        return QuantScheme("none")
    if quant not in ONLINE_METHODS:
        raise UnsupportedError(
            f"quant={quant!r} is not supported; choose None (as stored) or one of {sorted(ONLINE_METHODS)}"
        )
    return QuantScheme(quant)
