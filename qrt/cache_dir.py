"""qrt's cache folder, shared by everything qrt keeps between runs: the converted default model,
tokenizers built from GGUF metadata, the compile cache, the benches' files."""

import os
import pathlib


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """`cache_dir`, else $QRT_CACHE_DIR, else ~/.cache/qrt."""
    if cache_dir is None:
        cache_dir = os.environ.get("QRT_CACHE_DIR") or "~/.cache/qrt"
    return pathlib.Path(cache_dir).expanduser()
