"""Where a model's config and tensors come from: a safetensors folder or a GGUF file."""

from pathlib import Path

import torch

from qrt.checkpoint.config import LoadConfig, read_hf_config
from qrt.errors import CheckpointError
from qrt.formats.catalog import side_file_names
from qrt.checkpoint.safetensors_files import INDEX_NAME, checkpoint_files, stored_tensors
from qrt.checkpoint.tokenizer import load_tokenizer


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
    """A llama.cpp GGUF file: config, tensors and tokenizer all come from it. Kept quantized, its
    config says so (`quantization_config`: the `gguf` format with each tensor's GGML type), and
    the tensors of the types qrt runs as stored arrive as their blocks (checkpoint/gguf.py);
    otherwise every tensor is dequantized to the model dtype as it loads."""

    def __init__(self, path: Path, keep_quantized: bool = True):
        from qrt.checkpoint.gguf import GgufFile

        self.path = Path(path)
        self.folder = self.path.parent
        self.config_path = self.path
        self.keep_quantized = keep_quantized
        self.file = GgufFile(self.path)
        self.hf_config = self.file.hf_config
        # Whether the output layer is read from the embedding's blocks (the loader then lets the
        # embedding look its rows up in the output layer's weight: loader.share_embedding_rows).
        self.output_is_embedding = False
        if keep_quantized:
            self.output_is_embedding = self.file.untie_quantized_output()
            self.hf_config["quantization_config"] = {"quant_method": "gguf",
                                                     "tensor_types": self.file.tensor_types()}

    def tensors(self, dtype: torch.dtype):
        return [(self.path, name, tensor) for name, tensor in self.file.tensors(dtype, self.keep_quantized)]

    def identity_files(self, with_weights: bool = True) -> list[Path]:
        return [self.path]

    def load_tokenizer(self):
        from qrt.checkpoint.gguf_tokenizer import read_gguf_tokenizer

        return read_gguf_tokenizer(self.path, self.file.config)


def open_checkpoint(path, load_config: LoadConfig, keep_quantized: bool = True):
    """The checkpoint at `path` for `load_config.load_format` ("auto" picks by what is there).
    keep_quantized=False: a GGUF's tensors are all dequantized (another quantization was asked for)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, None, "no such file or folder")
    fmt = load_config.load_format
    if fmt == "auto":
        fmt = "gguf" if path.suffix == ".gguf" or (path.is_dir() and _lone_gguf(path) and
                                                    not (path / "config.json").exists()) else "safetensors"
    if fmt == "gguf":
        return GgufCheckpoint(path if path.is_file() else _lone_gguf(path, required=True), keep_quantized)
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
