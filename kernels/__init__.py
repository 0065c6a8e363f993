"""Kernels, registered as torch custom ops under the `qrt` namespace.

- `qrt::fp8_linear`: the logical op quantized layers call; its implementation is the
  plain-torch reference (fp8_reference.py), so eager mode is the oracle.
- `qrt::fp8_linear_cpu`: the CPU kernel (fp8_cpu.py).
- `qrt::fp8_linear_triton`: the Triton kernel (fp8_triton.py), registered where Triton imports.

Nothing here imports the rest of qrt; passes find these ops by name.
"""

from . import fp8_block, fp8_cpu, fp8_reference, fp8_static  # noqa: F401  (registration side effects)

try:
    from . import fp8_block_triton, fp8_static_triton, fp8_triton  # noqa: F401
except ImportError:  # no Triton on this platform: the CPU paths still work
    pass
