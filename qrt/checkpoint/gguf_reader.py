"""A GGUF (llama.cpp) file's header read with plain positioned reads: the metadata key/values, the
tensor table and where the tensor data starts, then one tensor's bytes at a time into a buffer of
its own.

gguf-py's reader maps the whole file and makes a numpy array of every string of the metadata (a
tokenizer's vocabulary and merges: 10^5 of them), which costs seconds and tens of MiB before a
tensor is read, and keeps every page it has read resident. Here the header is read in chunks, an
array of strings is only counted unless its key is asked for, and nothing of the file stays mapped.

Layout (GGUF v2/v3, little-endian): "GGUF", u32 version, u64 tensor count, u64 key/value count;
the key/values (string key, u32 value type, value); per tensor a string name, u32 dimension
count, u64 dimensions innermost first, u32 GGML type, u64 offset into the data; the data starts at
the next multiple of `general.alignment` (32 by default).
"""

import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qrt.errors import CheckpointError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_CHUNK = 1 << 20  # bytes of the header read at a time
_DEFAULT_ALIGNMENT = 32

# GGUF value type id -> struct format of one little-endian value; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_STRUCTS = {fmt: struct.Struct("<" + fmt) for fmt in _SCALARS.values()}


class _Truncated(Exception):
    """The header runs past the end of the file."""


@dataclass(frozen=True)
class StringArray:
    """An array of strings left undecoded: its length is all the config needs of a tokenizer's
    vocabulary or merges; `read_gguf_header(strings=...)` decodes the ones a caller asks for."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GgufTensorInfo:
    """One entry of the tensor table. `shape` is in torch order (outermost first: GGUF lists the
    dimensions innermost first); `offset` counts from the start of the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def quant_type(self):
        """gguf-py's GGMLQuantizationType of the tensor."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type)

    @property
    def type_name(self) -> str:
        """"Q4_1", "F32", ..."""
        return self.quant_type.name

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the innermost dimension), whole blocks for a quantized type."""
        weights_per_block, block_bytes = block_size(self.ggml_type)
        return self.shape[-1] // weights_per_block * block_bytes


@dataclass(frozen=True)
class GgufHeader:
    """Everything of a GGUF file but its tensor data."""

    path: Path
    version: int
    metadata: dict  # key -> int, float, bool, str, numpy array (numbers), list (strings, nested arrays) or StringArray
    tensors: list[GgufTensorInfo]
    alignment: int
    data_start: int  # file offset of the tensor data

    def read_tensor(self, tensor: GgufTensorInfo) -> np.ndarray:
        """The tensor's bytes, uint8 [*shape[:-1], row bytes], read into a fresh buffer."""
        buffer = np.empty(tensor.nbytes, dtype=np.uint8)  # [bytes]
        view = memoryview(buffer)
        with open(self.path, "rb", buffering=0) as file:
            done = 0
            while done < tensor.nbytes:
                got = os.preadv(file.fileno(), [view[done:]], tensor.offset + done)
                if got == 0:
                    raise CheckpointError(self.path, tensor.name, "the file ends inside the tensor's data")
                done += got
        return buffer.reshape(*tensor.shape[:-1], tensor.row_bytes)


def block_size(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type, from gguf-py's table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


class _Cursor:
    """Reads the file front to back through a window of at least `_CHUNK` bytes, refilled with
    os.pread where a read would run past it."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.window, self.start, self.pos = b"", 0, 0  # window holds the file's bytes [start, start + len)

    def _have(self, n: int) -> int:
        """Makes bytes [pos, pos + n) part of the window; returns pos's index in it."""
        if self.pos + n > self.start + len(self.window):
            if self.pos + n > self.size:
                raise _Truncated
            self.window, self.start = os.pread(self.fd, max(n, _CHUNK), self.pos), self.pos
            if len(self.window) < n:
                raise _Truncated
        return self.pos - self.start

    def take(self, n: int) -> bytes:
        at = self._have(n)
        self.pos += n
        return self.window[at:at + n]

    def unpack(self, fmt: str):
        layout = _STRUCTS[fmt]
        at = self._have(layout.size)
        self.pos += layout.size
        return layout.unpack_from(self.window, at)[0]

    def string(self) -> str:
        return self.take(self.unpack("Q")).decode("utf-8")

    def skip_strings(self, count: int) -> None:
        """Moves past `count` strings without decoding them (a vocabulary's worth in milliseconds)."""
        for _ in range(count):
            length = self.unpack("Q")  # read before pos is updated: unpack moves it
            self.pos += length
        if self.pos > self.size:
            raise _Truncated


def _value(cursor: _Cursor, value_type: int, decode_strings: bool):
    """One metadata value of `value_type`; an array of strings is counted unless `decode_strings`."""
    if value_type in _SCALARS:
        return cursor.unpack(_SCALARS[value_type])
    if value_type == _STRING:
        return cursor.string()
    if value_type != _ARRAY:
        raise ValueError(f"unknown metadata value type {value_type}")
    item_type, count = cursor.unpack("I"), cursor.unpack("Q")
    if item_type in _SCALARS:
        dtype = np.dtype("<" + _SCALARS[item_type])
        return np.frombuffer(cursor.take(count * dtype.itemsize), dtype=dtype).copy()  # [count]
    if item_type == _STRING and not decode_strings:
        cursor.skip_strings(count)
        return StringArray(count)
    return [_value(cursor, item_type, decode_strings) for _ in range(count)]


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, shape in torch order, GGML type, offset into the data) of the next tensor entry."""
    name = cursor.string()
    dims = [cursor.unpack("Q") for _ in range(cursor.unpack("I"))]
    return name, tuple(reversed(dims)), cursor.unpack("I"), cursor.unpack("Q")


def _parse(cursor: _Cursor, path: Path, strings: Collection[str]) -> GgufHeader:
    if cursor.take(4) != _MAGIC:
        raise ValueError("no GGUF magic at its start")
    version = cursor.unpack("I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} (a big-endian file, or not v2/v3), which qrt does not read")
    tensor_count, kv_count = cursor.unpack("Q"), cursor.unpack("Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = _value(cursor, cursor.unpack("I"), key in strings)
    entries = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [_located(path, cursor.size, data_start, *entry) for entry in entries]
    return GgufHeader(path, version, metadata, tensors, alignment, data_start)


def _located(path: Path, size: int, data_start: int, name: str, shape: tuple, ggml_type: int,
             offset: int) -> GgufTensorInfo:
    """The tensor entry with its place and size in the file, checked to lie within it."""
    try:
        weights_per_block, block_bytes = block_size(ggml_type)
    except (KeyError, ValueError):
        raise CheckpointError(path, name, f"unknown GGML type {ggml_type}") from None
    nbytes = int(np.prod(shape, dtype=np.int64)) // weights_per_block * block_bytes
    if data_start + offset + nbytes > size:
        raise CheckpointError(path, name, f"the file is truncated: the tensor's data ends at byte "
                                          f"{data_start + offset + nbytes}, past the file's {size}")
    return GgufTensorInfo(name, shape, ggml_type, data_start + offset, nbytes)


def read_gguf_header(path: Path, strings: Collection[str] = ()) -> GgufHeader:
    """The header of the GGUF file at `path`; the arrays of strings under the keys in `strings` are
    decoded, every other one is a StringArray. Raises CheckpointError naming the file where it is
    not a GGUF file qrt can read."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as file:
            return _parse(_Cursor(file.fileno(), os.fstat(file.fileno()).st_size), path, strings)
    except CheckpointError:
        raise
    except _Truncated:
        raise CheckpointError(path, None, "not a readable GGUF file (truncated inside its header)") from None
    except (ValueError, OSError) as err:
        raise CheckpointError(path, None, f"not a readable GGUF file ({err})") from None
