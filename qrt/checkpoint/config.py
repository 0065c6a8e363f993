"""Small configs `compile_model` fills from its keyword arguments, and reading config.json."""

from dataclasses import dataclass
from pathlib import Path

import torch

from qrt.errors import ConfigError
from qrt.formats.scheme import read_json

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


@dataclass
class LoadConfig:
    """How to read weights.

    load_format: "safetensors" (model.safetensors or a sharded index), "gguf" (a .gguf file,
    dequantized while loading), "dummy" (random weights of the right shapes, for benchmarks
    without a checkpoint), or "auto" (safetensors if present, else a single .gguf).
    """

    load_format: str = "auto"
    progress: bool = True
    seed: int = 0  # for load_format="dummy"

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")


@dataclass
class DeviceConfig:
    """Where the model runs and in which dtype (None: the checkpoint's torch_dtype).

    kernel_device: the device whose kernels the loader pass lays the weights out for; None: `device`.
    Tests set "cuda" on a CPU machine: the CUDA layouts are then made in CPU memory, where the Triton
    kernels run under TRITON_INTERPRET=1."""

    device: str | torch.device = "cpu"
    dtype: torch.dtype | str | None = None
    kernel_device: str | torch.device | None = None

    def __post_init__(self):
        self.device = torch.device(self.device)
        self.kernel_device = self.device if self.kernel_device is None else torch.device(self.kernel_device)
        if isinstance(self.dtype, str):
            self.dtype = parse_dtype(self.dtype)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(set(_DTYPES))}") from None


def read_hf_config(folder: Path) -> dict:
    """config.json of a checkpoint folder as a dict, with a clear error when it is unusable."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; a Hugging Face checkpoint folder needs config.json")
    return read_json(path)
