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

The file is not trusted: every count, length, dimension, type and offset is checked against the
bytes the file has left and against the limits below before anything is read or allocated by it,
and a file that fails a check is refused whole with a CheckpointError naming the field (see
docs/formats.md, "Hostile files").
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

# Limits on what a header may claim. Real files stay far below each (a few hundred keys, a few
# thousand tensors, a 262k-token vocabulary, names of under 64 bytes); above them a file is
# refused before its claim costs time or memory.
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22
MAX_NAME_BYTES = 1 << 16  # a key or a tensor's name (llama.cpp itself keeps names under 64)
MAX_ARRAY_DEPTH = 4  # arrays of arrays: llama.cpp reads none, gguf-py writes them
MAX_DIMS = 4  # GGML_MAX_DIMS
_INT64_MAX = (1 << 63) - 1
# The fewest bytes one entry can take, so that a count is checked against the file's bytes left:
# a key/value is a string length, a type and a 1-byte value; a tensor entry a name length, a
# dimension count, one dimension, a type and an offset; an array in an array its type and length.
_KV_MIN_BYTES = 8 + 4 + 1
_TENSOR_MIN_BYTES = 8 + 4 + 8 + 4 + 8
_ARRAY_MIN_BYTES = 4 + 8

# GGUF value type id -> struct format of one little-endian value; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_STRUCTS = {fmt: struct.Struct("<" + fmt) for fmt in _SCALARS.values()}


class _Refused(Exception):
    """A header field the file cannot hold or qrt does not read; `tensor` names the entry it is in."""

    def __init__(self, problem: str, tensor: str | None = None):
        super().__init__(problem)
        self.tensor = tensor


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
    os.pread where a read would run past it. Every read names the field it reads, for the error
    when the file ends inside it."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.window, self.start, self.pos = b"", 0, 0  # window holds the file's bytes [start, start + len)

    def left(self) -> int:
        return self.size - self.pos

    def _have(self, n: int, field: str) -> int:
        """Makes bytes [pos, pos + n) part of the window; returns pos's index in it. n is checked
        against the bytes left first, so a read is never larger than the file."""
        if n > self.left():
            raise _Refused(f"the file ends inside the {field} (truncated: {self.size} bytes, "
                           f"{n} more needed at byte {self.pos})")
        if self.pos + n > self.start + len(self.window):
            self.window, self.start = os.pread(self.fd, max(n, _CHUNK), self.pos), self.pos
            if len(self.window) < n:  # the file shrank while it was read
                raise _Refused(f"the file ends inside the {field} (it shrank while being read)")
        return self.pos - self.start

    def take(self, n: int, field: str) -> bytes:
        at = self._have(n, field)
        self.pos += n
        return self.window[at:at + n]

    def unpack(self, fmt: str, field: str):
        layout = _STRUCTS[fmt]
        at = self._have(layout.size, field)
        self.pos += layout.size
        return layout.unpack_from(self.window, at)[0]

    def count(self, field: str, item_bytes: int, limit: int) -> int:
        """A u64 count of items of at least `item_bytes` each, refused where it is over `limit` or
        more than the file's bytes left can hold."""
        n = self.unpack("Q", field)
        if n > limit:
            raise _Refused(f"{field} {n} is over qrt's limit of {limit}")
        if n * item_bytes > self.left():
            raise _Refused(f"{field} {n} needs at least {n * item_bytes} bytes, more than the {self.left()} "
                           f"the file has left at byte {self.pos} (a wrong count, or a truncated file)")
        return n

    def string(self, field: str, limit: int | None = None) -> str:
        raw = self.take(self.count(f"{field} length", 1, self.size if limit is None else limit), field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _Refused(f"the {field} is not UTF-8 ({err.reason} at its byte {err.start})") from None

    def skip_strings(self, count: int, field: str) -> None:
        """Moves past `count` strings without decoding them (a vocabulary's worth in milliseconds)."""
        for _ in range(count):
            length = self.unpack("Q", f"{field} string length")  # read before pos is updated: unpack moves it
            if length > self.left():
                raise _Refused(f"{field} string length {length} is more than the {self.left()} bytes the "
                               f"file has left at byte {self.pos} (a wrong length, or a truncated file)")
            self.pos += length


def _value(cursor: _Cursor, value_type: int, field: str, decode_strings: bool, depth: int = 0):
    """One metadata value of `value_type`; an array of strings is counted unless `decode_strings`."""
    if value_type in _SCALARS:
        return cursor.unpack(_SCALARS[value_type], field)
    if value_type == _STRING:
        return cursor.string(field)
    if value_type != _ARRAY:
        raise _Refused(f"{field} has the unknown value type {value_type}")
    if depth == MAX_ARRAY_DEPTH:
        raise _Refused(f"{field} nests arrays deeper than qrt's limit of {MAX_ARRAY_DEPTH}")
    item_type = cursor.unpack("I", f"{field} item type")
    if item_type in _SCALARS:
        dtype = np.dtype("<" + _SCALARS[item_type])
        count = cursor.count(f"{field} array length", dtype.itemsize, MAX_ARRAY_ITEMS)
        return np.frombuffer(cursor.take(count * dtype.itemsize, field), dtype=dtype).copy()  # [count]
    if item_type == _STRING:
        count = cursor.count(f"{field} array length", 8, MAX_ARRAY_ITEMS)
        if not decode_strings:
            cursor.skip_strings(count, field)
            return StringArray(count)
        return [cursor.string(f"{field} item {i}") for i in range(count)]
    if item_type == _ARRAY:
        count = cursor.count(f"{field} array length", _ARRAY_MIN_BYTES, MAX_ARRAY_ITEMS)
        return [_value(cursor, _ARRAY, f"{field} item {i}", decode_strings, depth + 1) for i in range(count)]
    raise _Refused(f"{field} is an array of the unknown value type {item_type}")


def _alignment(metadata: dict) -> int:
    """general.alignment, checked: an integer power of two (llama.cpp's rule)."""
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise _Refused(f"metadata general.alignment is {alignment!r}, not a power of two")
    return alignment


def _tensor_entry(cursor: _Cursor, index: int, alignment: int) -> tuple[str, tuple[int, ...], int, int, int]:
    """(name, shape in torch order, GGML type, offset into the data, bytes) of the next tensor
    entry, each field checked as it is read."""
    name = cursor.string(f"name of tensor #{index}", MAX_NAME_BYTES)
    try:
        n_dims = cursor.unpack("I", "dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Refused(f"dimension count {n_dims} is not 1 to {MAX_DIMS}")
        dims = [cursor.unpack("Q", f"dimension {i}") for i in range(n_dims)]
        for i, dim in enumerate(dims):
            if dim > _INT64_MAX:
                raise _Refused(f"dimension {i} is {dim}, negative as GGML's int64")
        elements = 1
        for dim in dims:
            elements *= dim
        if elements > _INT64_MAX:
            raise _Refused(f"dimensions {dims} hold {elements} elements, which overflows int64")
        ggml_type = cursor.unpack("I", "GGML type")
        try:
            weights_per_block, block_bytes = block_size(ggml_type)
        except (KeyError, ValueError):
            raise _Refused(f"GGML type {ggml_type} is unknown") from None
        if dims[0] % weights_per_block:
            raise _Refused(f"dimension 0 ({dims[0]}) is not whole blocks of {weights_per_block} weights "
                           f"of GGML type {ggml_type}")
        offset = cursor.unpack("Q", "data offset")
        if offset % alignment:
            raise _Refused(f"data offset {offset} is not a multiple of the alignment {alignment}")
    except _Refused as refused:
        raise _Refused(str(refused), name) from None
    return name, tuple(reversed(dims)), ggml_type, offset, elements // weights_per_block * block_bytes


def _parse(cursor: _Cursor, path: Path, strings: Collection[str]) -> GgufHeader:
    if cursor.take(4, "magic") != _MAGIC:
        raise _Refused("no GGUF magic at its start")
    version = cursor.unpack("I", "version")
    if version not in _VERSIONS:
        raise _Refused(f"GGUF version {version} (a big-endian file, or not v2/v3), which qrt does not read")
    tensor_count = cursor.count("tensor count", _TENSOR_MIN_BYTES, MAX_TENSORS)
    kv_count = cursor.count("metadata key/value count", _KV_MIN_BYTES, MAX_KEYS)
    metadata = {}
    for i in range(kv_count):
        key = cursor.string(f"metadata key #{i}", MAX_NAME_BYTES)
        if key in metadata:
            raise _Refused(f"metadata key #{i} {key!r} is there twice")
        metadata[key] = _value(cursor, cursor.unpack("I", f"value type of metadata {key}"), f"metadata {key}",
                               key in strings)
    alignment = _alignment(metadata)
    entries = [_tensor_entry(cursor, i, alignment) for i in range(tensor_count)]
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = _located(entries, data_start, cursor.size)
    return GgufHeader(path, version, metadata, tensors, alignment, data_start)


def _located(entries: list, data_start: int, size: int) -> list[GgufTensorInfo]:
    """The tensor entries with their place in the file, checked to lie within it, one name each,
    none overlapping another."""
    names = set()
    for name, *_ in entries:
        if name in names:
            raise _Refused("the tensor name is there twice", name)
        names.add(name)
    tensors = [GgufTensorInfo(name, shape, ggml_type, data_start + offset, nbytes)
               for name, shape, ggml_type, offset, nbytes in entries]
    previous = None
    for tensor in sorted(tensors, key=lambda t: t.offset):
        if tensor.offset + tensor.nbytes > size:
            raise _Refused(f"data offset {tensor.offset - data_start} puts the tensor's data at bytes "
                           f"[{tensor.offset}, {tensor.offset + tensor.nbytes}), past the file's {size}: "
                           f"the file is truncated", tensor.name)
        if previous is not None and tensor.nbytes and tensor.offset < previous.offset + previous.nbytes:
            raise _Refused(f"data offset {tensor.offset - data_start} overlaps tensor '{previous.name}'", tensor.name)
        if tensor.nbytes:
            previous = tensor
    return tensors


def read_gguf_header(path: Path, strings: Collection[str] = ()) -> GgufHeader:
    """The header of the GGUF file at `path`; the arrays of strings under the keys in `strings` are
    decoded, every other one is a StringArray. Raises CheckpointError naming the file (and the
    field, and the tensor where there is one) where it is not a GGUF file qrt can read."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as file:
            return _parse(_Cursor(file.fileno(), os.fstat(file.fileno()).st_size), path, strings)
    except _Refused as refused:
        raise CheckpointError(path, refused.tensor, f"not a readable GGUF file: {refused}") from None
    except OSError as err:
        raise CheckpointError(path, None, f"not a readable GGUF file ({err})") from None
