"""Find and stream the tensors of a safetensors checkpoint, one tensor at a time."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards an index names, or model.safetensors."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(index, None, f"not a valid safetensors index ({err!r})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(index, None, f"names shard(s) {missing} that are not in {folder}")
        return files
    single = folder / SINGLE_NAME
    if single.is_file():
        return [single]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        return [folder / name for name in others]
    raise CheckpointError(folder, None, f"no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors found")


def count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        with _open(path) as handle:
            total += len(handle.keys())
    return total


def iter_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, name, tensor) one tensor at a time, so at most one checkpoint tensor is
    held in memory beside the model."""
    for path in files:
        with _open(path) as handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as err:  # safetensors raises its own error types
                    raise CheckpointError(path, name, f"cannot be read ({err})") from None
                yield path, name, tensor


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # a truncated or foreign file fails inside the Rust reader
        raise CheckpointError(path, None, f"not a readable safetensors file ({err})") from None
