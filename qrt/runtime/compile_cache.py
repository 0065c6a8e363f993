"""qrt's compile cache: the compiled graphs of one (qrt, torch, checkpoint, format, device, shapes)
combination, kept as one file so that a second process starts without compiling.

An entry holds one of two payloads (its metadata's "payload" says which; `GraphRunner` writes
and reads them, docs/startup.md):
- "graphs": each step graph as a serialized artifact of Inductor's `standalone_compile`, with
  the spec that binds it to a model's weights (runtime/direct_graph.py): a start that finds it
  calls the graphs without tracing the model;
- "torch caches": what torch's own caches need to serve every compile of `warmup()`
  (AOTAutograd and Inductor's FX graph cache, autotuning results, the dynamic-shape profile), as
  `torch.compiler.save_cache_artifacts()` serializes them; a start hands it to
  `torch.compiler.load_cache_artifacts()` and every compile is then a cache hit. Those caches key
  each graph on its own contents, so a stale artifact is never used for a graph it does not match.
The entry's key (below) makes sure it belongs to this model at all.

File layout (`<root>/compiled/<key>.qrtc`): the magic line, one JSON line of metadata (what the
entry is for, the payload's size and SHA-256), then the payload. Entries are written to a
temporary file and renamed into place, so a reader sees a whole entry or none. A truncated or
corrupt entry is reported in one line, deleted and rebuilt.
"""

import atexit
import hashlib
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from qrt.cache_dir import cache_root

MAGIC = b"qrt-compile-cache 1\n"
SUFFIX = ".qrtc"


def compiled_dir() -> Path:
    return cache_root() / "compiled"


_set_by_qrt: str | None = None  # the TORCHINDUCTOR_CACHE_DIR value qrt last set


def qrt_inductor_dir() -> Path:
    return cache_root() / "inductor"


def use_qrt_inductor_dir() -> Path:
    """Keep Inductor's on-disk caches (generated code, compiled C++ kernels) in qrt's cache folder
    unless the user chose a folder with TORCHINDUCTOR_CACHE_DIR. An entry's artifacts let torch skip
    tracing and code generation; the compiled kernels themselves live there, and without them a
    warm start compiles every C++ kernel again, most of its time."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    global _set_by_qrt
    # Inductor writes its default into the variable on first use, and qrt its own folder, so only
    # another value is the user's choice.
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is not None and os.path.abspath(chosen) not in (os.path.abspath(default_cache_dir()), _set_by_qrt):
        return Path(chosen)
    folder = qrt_inductor_dir()
    if not _writable(folder):
        # Inductor must write its generated code and compiled kernels somewhere before it can load
        # them; a cache folder that is read-only (or not a folder) would stop the compile. Compile
        # into a folder of this process instead: the run works, uncached.
        fallback = Path(tempfile.mkdtemp(prefix="qrt-inductor-"))
        atexit.register(shutil.rmtree, fallback, ignore_errors=True)
        print(f"qrt: warning: the cache folder {folder} cannot be written; compiling without a cache "
              f"(set QRT_CACHE_DIR to a writable folder to keep compiled graphs between runs)",
              file=sys.stderr, flush=True)
        folder = fallback
    _set_by_qrt = os.path.abspath(folder)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _set_by_qrt
    return folder


def _writable(folder: Path) -> bool:
    """Whether a file can be made in `folder` (made if missing). Tried, not judged from the mode
    bits: root ignores them, while a read-only mount or a full disk refuses root too."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".qrt-probe-"):
            pass
        return True
    except OSError:
        return False


@cache
def qrt_source_hash() -> str:
    """SHA-256 over every Python file of qrt: any edit invalidates every entry."""
    digest = hashlib.sha256()
    top = Path(__file__).resolve().parents[1]
    for path in sorted(top.rglob("*.py")):
        digest.update(str(path.relative_to(top)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def checkpoint_identity(files: list[Path]) -> list:
    """What identifies a checkpoint without reading its weights: each file's name and size, its
    config.json in full, and the header of each safetensors file (every tensor's name, dtype,
    shape and offsets). For other files (GGUF) the first MiB, which holds its metadata."""
    identity = []
    for path in sorted(files):
        entry = {"name": path.name, "size": path.stat().st_size}
        with open(path, "rb") as handle:
            if path.suffix == ".safetensors":
                (length,) = struct.unpack("<Q", handle.read(8))
                entry["header"] = hashlib.sha256(handle.read(length)).hexdigest()
            else:
                entry["head"] = hashlib.sha256(handle.read(1 << 20)).hexdigest()
        identity.append(entry)
    return identity


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def entry_key(parts: dict) -> tuple[str, dict]:
    """The key of an entry for `parts` (what the caller compiles: checkpoint identity, format,
    device, dtype, shapes, build), with the versions of qrt, torch and Triton added."""
    parts = {**parts, "qrt": qrt_source_hash(), "torch": torch.__version__, "triton": _triton_version(),
             "python": sys.version.split()[0], "machine": platform.machine()}
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32], parts


class CorruptEntry(Exception):
    pass


@dataclass
class Entry:
    path: Path
    meta: dict
    size: int


def _read_meta(handle) -> dict:
    """The metadata line of an open entry file (left positioned at the payload), or CorruptEntry."""
    if handle.read(len(MAGIC)) != MAGIC:
        raise CorruptEntry("not a qrt compile-cache file")
    head = handle.readline()
    if not head.endswith(b"\n"):
        raise CorruptEntry("truncated metadata")
    try:
        meta = json.loads(head)
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or not {"payload_bytes", "payload_sha256"} <= meta.keys():
        raise CorruptEntry("unreadable metadata")
    return meta


def _read(path: Path) -> tuple[dict, bytes]:
    """(metadata, payload) of an entry file, or CorruptEntry saying what is wrong with it."""
    with open(path, "rb") as handle:
        meta = _read_meta(handle)
        payload = handle.read()
    size, digest = meta["payload_bytes"], meta["payload_sha256"]
    if len(payload) != size:
        raise CorruptEntry(f"payload is {len(payload)} bytes, expected {size} (truncated)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptEntry("payload checksum mismatch")
    return meta, payload


class CompileCache:
    """Entries of one key. `load()` returns the payload or None; `store()` writes it atomically."""

    def __init__(self, key: str, parts: dict, directory: Path | None = None):
        self.key = key
        self.parts = parts
        self.path = (directory or compiled_dir()) / f"{key}{SUFFIX}"

    def load(self, report=print) -> tuple[dict, bytes] | None:
        """The entry's (metadata, payload), or None when there is none or it was corrupt (then it
        is deleted, and `report` gets one line saying so)."""
        if not self.path.exists():
            return None
        try:
            return _read(self.path)
        except (CorruptEntry, OSError) as err:
            report(f"qrt: compile cache entry {self.path} is unusable ({err}); deleting it and compiling anew")
            self.path.unlink(missing_ok=True)
            return None

    def discard(self, reason: str, report=print) -> None:
        report(f"qrt: compile cache entry {self.path} could not be loaded ({reason}); deleting it and compiling anew")
        self.path.unlink(missing_ok=True)

    def store(self, payload: bytes, meta: dict) -> None:
        meta = {**meta, "key": self.key, "created": time.time(), "parts": self.parts,
                "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(MAGIC)
                handle.write(json.dumps(meta, default=str).encode() + b"\n")
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def list_entries(directory: Path | None = None) -> list[Entry | tuple[Path, str]]:
    """Every entry file, newest first: an Entry, or (path, what is wrong) for an unreadable one."""
    directory = directory or compiled_dir()
    found = []
    for path in sorted(directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            meta, _ = _read(path)
        except (CorruptEntry, OSError) as err:
            found.append((path, str(err)))
            continue
        found.append(Entry(path, meta, path.stat().st_size))
    return found


def clear_entries() -> tuple[int, int]:
    """Delete every entry, leftover temporary files and qrt's Inductor folder; (files, bytes) removed."""
    files = total = 0
    paths = [*compiled_dir().glob(f"*{SUFFIX}"), *compiled_dir().glob(".*.tmp")]
    if qrt_inductor_dir().is_dir():
        paths += [p for p in qrt_inductor_dir().rglob("*") if p.is_file() or p.is_symlink()]
    for path in paths:
        total += path.lstat().st_size
        path.unlink(missing_ok=True)
        files += 1
    if qrt_inductor_dir().is_dir():
        shutil.rmtree(qrt_inductor_dir(), ignore_errors=True)
    return files, total


def last_cold_compile_seconds(device: str, directory: Path | None = None) -> float | None:
    """How long the newest cold compile on this device took (recorded in its entry), for the
    progress line's estimate. Reads only the entries' metadata lines, not their payloads."""
    directory = directory or compiled_dir()
    for path in sorted(directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            with open(path, "rb") as handle:
                meta = _read_meta(handle)
        except (CorruptEntry, OSError):
            continue
        if meta.get("device") == device and meta.get("compile_seconds"):
            return float(meta["compile_seconds"])
    return None
