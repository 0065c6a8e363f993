"""Exceptions qrt raises for checkpoints and arguments a user can fix.

Every message names the file (and tensor, where there is one), what was expected and what was
found, so the user can act without reading a traceback.
"""


class QrtError(Exception):
    """Base class of every error qrt raises on purpose."""


class ConfigError(QrtError, ValueError):
    """config.json (or a quantization side file) is missing, unreadable or inconsistent."""


class CheckpointError(QrtError, ValueError):
    """A weight file or one of its tensors does not match what the model expects."""

    def __init__(self, file, tensor: str | None, problem: str):
        where = f"{file}" if tensor is None else f"{file}: tensor '{tensor}'"
        super().__init__(f"{where}: {problem}")
        self.file = str(file)
        self.tensor = tensor


class UnsupportedError(QrtError, NotImplementedError):
    """The checkpoint uses an architecture, format or option qrt does not support (yet)."""


class TensorMismatch(QrtError, ValueError):
    """Raised by weight loaders; the loader re-raises it as CheckpointError with file context."""
