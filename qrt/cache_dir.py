"""qrt's cache folder, shared by everything qrt keeps between runs: the converted default model,
tokenizers built from GGUF metadata, the compile cache, the benches' files."""

import os
import pathlib


def write_cache_file(path: pathlib.Path, text: str) -> None:
    """Write a small file of qrt's cache to a temporary file beside it and rename it into place,
    so that a reader never sees half of one. A folder that cannot be written only costs the next
    run the work the file would have saved, so the error is dropped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError:
        pass


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """`cache_dir`, else $QRT_CACHE_DIR, else ~/.cache/qrt."""
    if cache_dir is None:
        cache_dir = os.environ.get("QRT_CACHE_DIR") or "~/.cache/qrt"
    return pathlib.Path(cache_dir).expanduser()
