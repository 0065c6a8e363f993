"""Where a model's config and tensors come from: a safetensors folder or a GGUF file."""

from dataclasses import dataclass
from pathlib import Path

import torch

from qrt.checkpoint.config import LoadConfig, read_hf_config
from qrt.errors import CheckpointError
from qrt.formats.catalog import side_file_names
from qrt.checkpoint.safetensors_files import INDEX_NAME, checkpoint_files, stored_tensors
from qrt.layers.tensor_parallel import cut_tensor
from qrt.checkpoint.tokenizer import load_tokenizer


@dataclass(frozen=True)
class TensorInMemory:
    """A tensor already read (GGUF dequantizes while reading), with StoredTensor's interface."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple:
        return tuple(self.tensor.shape)

    def read(self, cuts=()) -> torch.Tensor:
        return cut_tensor(self.tensor, cuts) if cuts else self.tensor


class SafetensorsCheckpoint:
    """A Hugging Face folder: config.json, model.safetensors or a sharded index, tokenizer files."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.config_path = self.folder / "config.json"
        self.hf_config = read_hf_config(self.folder)

    def tensors(self, dtype: torch.dtype) -> list:
        """(file, name, StoredTensor) of every weight, read only when the loader asks."""
        return stored_tensors(checkpoint_files(self.folder))

    def identity_files(self, with_weights: bool = True) -> list[Path]:
        """The files whose contents decide what qrt builds: config and quantization side files,
        and the weight files (whose headers the compile cache hashes)."""
        # Files beside config.json that can change how the checkpoint loads: quantization side files, the index.
        side = [self.folder / name for name in (*side_file_names(), INDEX_NAME) if (self.folder / name).is_file()]
        return [self.config_path, *side, *(checkpoint_files(self.folder) if with_weights else [])]

    def load_tokenizer(self):
        return load_tokenizer(self.folder)


class GgufCheckpoint:
    """A llama.cpp GGUF file, dequantized to the model dtype as it loads (config, tensors and
    tokenizer all come from the file's metadata)."""

    def __init__(self, path: Path):
        from qrt.checkpoint.gguf import read_gguf_config

        self.path = Path(path)
        self.folder = self.path.parent
        self.config_path = self.path
        self.hf_config = read_gguf_config(self.path)

    def tensors(self, dtype: torch.dtype):
        from qrt.checkpoint.gguf import read_gguf_tensors

        return [(self.path, name, TensorInMemory(tensor)) for name, tensor in read_gguf_tensors(self.path, dtype).items()]

    def identity_files(self, with_weights: bool = True) -> list[Path]:
        return [self.path]

    def load_tokenizer(self):
        from qrt.checkpoint.gguf import read_gguf_tokenizer

        return read_gguf_tokenizer(self.path)


def open_checkpoint(path, load_config: LoadConfig):
    """The checkpoint at `path` for `load_config.load_format` ("auto" picks by what is there)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, None, "no such file or folder")
    fmt = load_config.load_format
    if fmt == "auto":
        fmt = "gguf" if path.suffix == ".gguf" or (path.is_dir() and _lone_gguf(path) and
                                                    not (path / "config.json").exists()) else "safetensors"
    if fmt == "gguf":
        return GgufCheckpoint(path if path.is_file() else _lone_gguf(path, required=True))
    if path.is_file():
        raise CheckpointError(path, None, "expected a checkpoint folder (config.json + *.safetensors)")
    return SafetensorsCheckpoint(path)  # also "dummy": only its config is read


def _lone_gguf(folder: Path, required: bool = False) -> Path | None:
    found = sorted(folder.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    if required:
        problem = "no .gguf file" if not found else f"{len(found)} .gguf files; pass the one to load"
        raise CheckpointError(folder, None, problem)
    return None
