"""The first step of loading, shared by `compile_model` and `qrt inspect`: from what a user names
(a checkpoint folder, a GGUF file, a Hugging Face Hub id, or nothing for the default model) and a
`quant=` argument to
the opened checkpoint, the model class of its architecture and its quantization scheme. Each of
these fails here, before any weight is read, with an error that names the file."""

from dataclasses import dataclass
from pathlib import Path

from qrt.checkpoint.config import LoadConfig
from qrt.checkpoint.hub import locate
from qrt.checkpoint.source import open_checkpoint
from qrt.formats.catalog import side_file_names
from qrt.formats.resolve import resolve_scheme
from qrt.formats.scheme import QuantScheme

from .registry import ModelRegistry


@dataclass(frozen=True)
class Resolved:
    path: Path
    checkpoint: object  # checkpoint/source.py: a safetensors folder or a GGUF file, opened
    model_cls: type
    scheme: QuantScheme

    @property
    def hf_config(self) -> dict:
        return self.checkpoint.hf_config


def resolve(path, quant: str | None, load_config: LoadConfig, *, revision: str | None = None,
            progress: bool = True) -> Resolved:
    """path None: the default model, its GGUF file as the package ships it. A hub id
    (checkpoint/hub.py) is fetched at `revision` into the Hugging Face cache, or found there."""
    if path is None:
        from .default_model import gguf_path

        path = gguf_path()
    path = locate(path, revision, progress, side_files=side_file_names())
    # A GGUF runs in its own quantization unless another is asked for ("none": dequantized).
    checkpoint = open_checkpoint(path, load_config, keep_quantized=quant in (None, "gguf"))
    model_cls = ModelRegistry.resolve(checkpoint.hf_config, source=checkpoint.config_path)
    scheme = resolve_scheme(checkpoint.hf_config, quant, checkpoint.config_path, checkpoint.folder)
    return Resolved(Path(path), checkpoint, model_cls, scheme)
