"""Inductor's check of the CPU's vector instruction sets, remembered across processes.

Before it loads or builds a C++ kernel, Inductor finds which of AVX2, AVX-512 (with BF16, VNNI)
and AMX this CPU and compiler can use: it compiles a small test library for each and loads it in
a child Python process (`VecISA._probe_load`). On this project's 2-core machines that is about ten
child processes and 1.3 s of every start, a fifth of a warm one, to learn what the previous start
already learned. qrt keeps the libraries that loaded in a small file in its cache folder, keyed by
the library's bytes and this CPU's flags, and skips the child process for them. A library that
failed to load is never remembered, so it is probed again, as torch would.
"""

import functools
import hashlib
import json
from pathlib import Path

from qrt.cache_dir import cache_root, write_cache_file


def remember_isa_probes() -> None:
    """Wrap Inductor's probe (once per process) so that what loaded before is not probed again.
    A torch without that probe is left as it is."""
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        return
    probe = getattr(VecISA, "_probe_load", None)
    if probe is None or getattr(probe, "remembered", False):
        return

    @functools.wraps(probe)
    def probe_load(isa, output_path: str) -> bool:
        key = _library_key(output_path)
        if key is not None and key in _loaded():
            return True
        loaded = probe(isa, output_path)
        if loaded and key is not None:
            _remember(key)
        return loaded

    probe_load.remembered = True
    VecISA._probe_load = probe_load


def _record() -> Path:
    return cache_root() / "isa-probes.json"


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def _library_key(path: str) -> str | None:
    """The library's bytes and this CPU's flags, hashed: what decides whether it loads here."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return hashlib.sha256(data + _cpu_flags().encode()).hexdigest()


def _loaded() -> set[str]:
    try:
        return set(json.loads(_record().read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def _remember(key: str) -> None:
    """Add a key (a folder that cannot be written only costs the probe next time)."""
    write_cache_file(_record(), json.dumps(sorted(_loaded() | {key})))
