"""Find the weight files of a safetensors checkpoint and stream their tensors one at a time.

The reader is our own rather than safetensors' memory map: reading each tensor with plain file
reads into a fresh buffer keeps peak memory at the model plus one tensor, where a memory map
leaves the whole file's pages resident until it closes (a second copy of the weights). It also
checks the header against the file, so a truncated or corrupted file fails with its name and the
tensor at fault rather than deep inside a kernel.

Format: 8 bytes little-endian header length n, n bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets count from its start.
"""

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qrt.errors import CheckpointError
from qrt.layers.tensor_parallel import cut_tensor, stored_entries, zero_padded

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    dtype_name: str
    shape: tuple
    begin: int  # absolute byte offset in the file
    nbytes: int


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards an index names, or model.safetensors."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(index, None, f"not a valid safetensors index ({err!r})") from None
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(index, None, f"names shard(s) {missing} that are not in {folder}")
        _check_shards(files, weight_map)
        return files
    single = folder / SINGLE_NAME
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        _check_shards(others, None)
        return others
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")) if folder.is_dir() else []
    if pickles:
        raise CheckpointError(folder, None, (
            f"holds only PyTorch pickle weights ({', '.join(pickles)}); qrt does not load them, because "
            f"unpickling can run code from the file. Convert them once, where you trust the file: "
            f"AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)"))
    raise CheckpointError(folder, None, f"no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors found")


def _check_shards(files: list[Path], weight_map: dict | None) -> None:
    """Every tensor lives in exactly one shard, the one the index (if any) names."""
    home: dict[str, Path] = {}
    for path in files:
        for entry in read_header(path):
            if entry.name in home:
                raise CheckpointError(path, entry.name, f"is also in {home[entry.name].name}; a tensor must "
                                      f"live in one shard")
            home[entry.name] = path
    for name, shard in (weight_map or {}).items():
        if name not in home or home[name].name != shard:
            found = f"it is in {home[name].name}" if name in home else "no shard has it"
            raise CheckpointError(files[0].parent / shard, name, f"listed in {INDEX_NAME} for this shard, "
                                  f"but {found}")


def read_header(path: Path) -> list[TensorEntry]:
    """The tensor table of one file, validated against the file's size before any tensor is read:
    the header's length, encoding and JSON, each entry's dtype, shape and offsets, and the
    entries' places in the file (docs/formats.md, "Hostile files")."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(path, None, f"not a safetensors file: {size} bytes, too short for a header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(path, None, f"not a safetensors file: its header length {header_len} is over "
                                  f"the format's limit of {MAX_HEADER_BYTES} bytes")
        if header_len > size - 8:
            raise CheckpointError(path, None, f"not a safetensors file, or truncated: header length {header_len} "
                                  f"is more than the {size - 8} bytes the file has after the length field")
        raw = handle.read(header_len)
    if len(raw) < header_len:  # the file shrank since it was measured
        raise CheckpointError(path, None, f"truncated: the file ends inside its {header_len}-byte header")
    header = _json_header(path, raw)
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(path, None, "corrupted safetensors header: __metadata__ is not a map of strings")
    entries = [_entry(path, name, info, data_start) for name, info in header.items()]
    _check_layout(path, entries, size)
    return entries


def _json_header(path: Path, raw: bytes) -> dict:
    """The header's JSON object. UTF-8 only (json.loads would take bytes in UTF-16 or UTF-32 too),
    and a name given twice is refused rather than letting the last entry win."""
    def unique(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen[key] = value
        return seen

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except UnicodeDecodeError as err:
        raise CheckpointError(path, None, f"corrupted safetensors header: not UTF-8 ({err.reason} at header "
                              f"byte {err.start})") from None
    except _Duplicate as duplicate:
        raise CheckpointError(path, duplicate.name, "the header names this tensor twice") from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(path, None, f"corrupted safetensors header: not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, None, "corrupted safetensors header: not a JSON object")
    return header


class _Duplicate(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


MAX_DIMS = 8  # more dimensions than any weight has; the count bounds the cost of the shape's checks
_INT64_MAX = (1 << 63) - 1


def _entry(path: Path, name: str, info, data_start: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        keys = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise CheckpointError(path, name, f"corrupted header entry: has {keys}, not dtype, shape and data_offsets")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise CheckpointError(path, name, f"unknown dtype {dtype_name!r}; known: {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise CheckpointError(path, name, f"shape {shape!r} is not a list of at most {MAX_DIMS} dimensions")
    if not all(type(d) is int and 0 <= d <= _INT64_MAX for d in shape):  # type(): a bool is no size
        raise CheckpointError(path, name, f"shape {shape!r} has a dimension that is not an integer in "
                              f"[0, 2^63)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise CheckpointError(path, name, f"data_offsets {offsets!r} are not two byte offsets")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(path, name, f"data_offsets {offsets} are out of order (begin after end)")
    dtype = DTYPES[dtype_name]
    elements = math.prod(shape)
    if elements > _INT64_MAX:
        raise CheckpointError(path, name, f"shape {shape} holds {elements} elements, which overflows int64")
    expected = elements * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(path, name, f"header gives {end - begin} bytes for shape {list(shape)} "
                              f"{dtype_name}, which needs {expected}")
    return TensorEntry(name, dtype, dtype_name, tuple(shape), data_start + begin, expected)


def _check_layout(path: Path, entries: list[TensorEntry], size: int) -> None:
    previous = None
    for entry in sorted(entries, key=lambda e: e.begin):
        if entry.begin + entry.nbytes > size:
            raise CheckpointError(path, entry.name, f"data ends at byte {entry.begin + entry.nbytes}, past "
                                  f"the end of the file ({size} bytes): data_offsets are wrong or the file "
                                  f"is truncated")
        if previous is not None and entry.nbytes and entry.begin < previous.begin + previous.nbytes:
            raise CheckpointError(path, entry.name, f"data_offsets: its data overlaps tensor '{previous.name}': "
                                  f"corrupted header")
        if entry.nbytes:
            previous = entry


def count_tensors(files: list[Path]) -> int:
    return sum(len(read_header(path)) for path in files)


def iter_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, name, tensor), one tensor in memory at a time, in file order."""
    for path, name, stored in stored_tensors(files):
        yield path, name, stored.read()


def stored_tensors(files: list[Path]) -> list[tuple[Path, str, "StoredTensor"]]:
    """(file, name, StoredTensor) of every tensor, in file order; nothing is read but the headers."""
    return [(path, entry.name, StoredTensor(path, entry))
            for path in files for entry in sorted(read_header(path), key=lambda e: e.begin)]


# Rows read at a time when a cut runs along an inner dim: bounds the transient buffer.
_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class StoredTensor:
    """A tensor in a safetensors file, read on demand, whole or cut to a rank's part
    (tensor_parallel.DimCut): a cut along dim 0 reads only its rows' bytes; a cut along an inner
    dim reads rows a few MiB at a time and keeps their part."""

    path: Path
    entry: TensorEntry

    @property
    def shape(self) -> tuple:
        return self.entry.shape

    def read(self, cuts=()) -> torch.Tensor:
        if not cuts:
            return self._rows(0)
        if len(cuts) > 1:
            raise ValueError(f"{self.entry.name}: one cut per tensor, got {len(cuts)}")
        (cut,) = cuts
        if cut.dim == 0:
            pieces = [zero_padded(self._rows(start, stored_entries(start, length, cut.size)), length, 0)
                      for start, length in cut.segments]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        rows = self.entry.shape[0]
        row_bytes = max(self.entry.nbytes // max(rows, 1), 1)
        step = max(1, _CHUNK_BYTES // row_bytes)
        return torch.cat([cut_tensor(self._rows(start, min(step, rows - start)), cuts)
                          for start in range(0, rows, step)])

    def _rows(self, start: int, count: int | None = None) -> torch.Tensor:
        """Rows [start, start + count) along dim 0; count None: the whole tensor."""
        entry = self.entry
        shape = entry.shape if count is None else (count, *entry.shape[1:])
        tensor = torch.empty(shape, dtype=entry.dtype)
        nbytes = tensor.numel() * entry.dtype.itemsize
        if nbytes == 0:
            return tensor
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape else entry.nbytes
        with open(self.path, "rb") as handle:
            handle.seek(entry.begin + start * row_bytes)
            buffer = tensor.view(-1).view(torch.uint8).numpy()  # shares memory with `tensor`
            if handle.readinto(buffer) != nbytes:
                raise CheckpointError(self.path, entry.name, "file ended while reading the tensor: truncated")
        return tensor
