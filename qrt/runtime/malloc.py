"""Keep large allocations out of glibc's heap, so that memory freed while loading goes back to the
system instead of raising the process's peak.

glibc serves an allocation above its mmap threshold with a mapping of its own, returned to the
system when freed; smaller ones come from the heap, which rarely shrinks. The threshold starts at
128 KiB but rises (up to 32 MiB) each time a mapped block is freed, so after the first few layers
the loader's per-layer temporaries (unpacked codes, float32 copies, repacked weights: MiBs each)
land in the heap and fragment it. A fixed 1 MiB threshold stops that; it matters most for the
integer formats, whose loader pass unpacks and repacks every weight (bench/startup.py reports
the peak resident memory of every format).
"""

import ctypes
import ctypes.util
import sys
from functools import cache

_M_MMAP_THRESHOLD = -3  # mallopt parameter number, from glibc's malloc.h
THRESHOLD_BYTES = 1 << 20


@cache
def map_large_allocations() -> bool:
    """Set glibc's mmap threshold once per process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES))
