"""qrt: a torch.compile-first runtime for quantized LLM checkpoints."""

from loaders.config import DeviceConfig, LoadConfig
from loaders.errors import CheckpointError, ConfigError, QrtError, UnsupportedError

from .compiled import CompiledModel, compile_model
from .registry import ModelRegistry

__all__ = [
    "CheckpointError", "CompiledModel", "ConfigError", "DeviceConfig", "LoadConfig",
    "ModelRegistry", "QrtError", "UnsupportedError", "compile_model",
]
