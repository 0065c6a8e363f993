"""qrt: a torch.compile-first runtime for quantized LLM checkpoints."""

from qrt.checkpoint.config import DeviceConfig, LoadConfig
from qrt.errors import CheckpointError, ConfigError, QrtError, UnsupportedError

from .compiled import CompiledModel, compile_model
from .reasoning import ChatAnswer
from .registry import ModelRegistry

__all__ = [
    "ChatAnswer", "CheckpointError", "CompiledModel", "ConfigError", "DeviceConfig", "LoadConfig",
    "ModelRegistry", "QrtError", "UnsupportedError", "compile_model",
]
