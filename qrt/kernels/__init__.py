"""Kernels, registered as torch custom ops under the `qrt` namespace.

Each scheme has a logical op that quantized layers call, whose implementation is the plain-torch
reference (so eager mode is the oracle), and kernel ops that run in its place when compiled. A
module's name says what it holds: `<family>_reference.py` the logical ops, `<family>_cpu.py` the CPU
kernels, `<family>_triton.py` the Triton kernels. Each kernel module declares its kernels
(choices.py): which logical op a kernel serves, on which device, for which weight layout, and which
inputs it may take already quantized. `qrt inspect` and `qrt dump` show the choice made for each layer.

Every module of this package is imported here, so a new kernel is a new file. The Triton modules
import only where Triton does; without it the CPU paths still work. Nothing here imports the rest
of qrt; passes find these ops by name.
"""

import importlib
import importlib.util
import pkgutil

_HAS_TRITON = importlib.util.find_spec("triton") is not None

for _module in pkgutil.iter_modules(__path__):
    if _HAS_TRITON or "triton" not in _module.name:
        importlib.import_module(f"{__name__}.{_module.name}")
