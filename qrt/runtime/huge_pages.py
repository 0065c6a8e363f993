"""A CPU model's weights moved into transparent huge pages once they are loaded.

A decode step streams every weight from memory. In 4 KiB pages that is a TLB miss every 4 KiB and
a page walk for each, and the physical pages land wherever the allocator found them, so two
processes loading the same model read it at different speeds. Linux backs an anonymous mapping
with 2 MiB pages where the mapping asks for them (`madvise(MADV_HUGEPAGE)`, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise"), so the weights are copied,
once, into one such mapping: measured on an AMD EPYC (2 threads), a Q4_K GEMV over 60 MB of
weights ran 1.2 times as fast in the median of ten processes and spread less (docs/cpu-kernels.md).

Only plain, contiguous CPU tensors that own their whole storage move (not oneDNN's prepacked
carriers, not views sharing storage with another tensor); values, shapes and dtypes are unchanged.
QRT_HUGE_PAGES=0 leaves the weights where they were loaded.
"""

import mmap
import os
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each tensor starts on a cache line
MIN_BYTES = 64 << 10  # smaller tensors are not worth their own copy
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages (and has not been told not to)."""
    if os.environ.get("QRT_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def _movable(tensor: torch.Tensor) -> bool:
    return (type(tensor) is torch.Tensor and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            and tensor.numel() * tensor.element_size() >= MIN_BYTES)


def place_weights_in_huge_pages(model: nn.Module) -> int:
    """Copy the model's movable parameters into one huge-page mapping; returns the bytes moved."""
    if not huge_pages_available():
        return 0
    params = [p for p in model.parameters() if _movable(p.data)]  # parameters() yields a tied one once
    if not params:
        return 0
    sizes = [p.numel() * p.element_size() for p in params]
    total = sum(-(-size // ALIGNMENT) * ALIGNMENT for size in sizes)
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before anything touches it: its pages are faulted in huge
    offset = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE  # the first on a huge page
    for param, size in zip(params, sizes):
        # A storage of its own over its part of the mapping (which each keeps alive): views of one
        # storage would be aliased inputs to a compiled graph.
        place = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset)
        place = place.view(param.dtype).view(param.shape)
        place.copy_(param.data)
        param.data = place  # the loaded storage is freed here, one tensor at a time
        offset += -(-size // ALIGNMENT) * ALIGNMENT
    return sum(sizes)
