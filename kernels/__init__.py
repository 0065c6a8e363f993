"""Kernels, registered as torch custom ops under the `qrt` namespace.

Each scheme has a logical op that quantized layers call, whose implementation is the plain-torch
reference (so eager mode is the oracle), and kernel ops the swap pass puts in its place:

| logical op (reference)                    | CPU kernel               | GPU kernel (Triton)          |
|-------------------------------------------|--------------------------|------------------------------|
| `qrt::fp8_linear` (per-token activations) | `fp8_linear_cpu`         | `fp8_linear_triton`          |
| `qrt::fp8_static_linear` (static scale)   | `fp8_static_linear_cpu`  | `fp8_static_linear_triton`   |
| `qrt::fp8_block_linear` (block weights)   | `fp8_block_linear_cpu`   | `fp8_block_linear_triton`    |
| `qrt::int_linear` (int weight-only)       | see below                | `int_linear_triton`          |

On the CPU, integer weight-only layers are packed by the loader pass into the opaque layouts of
ATen's int matmuls and call `int4pack_linear` / `int8pack_linear` (int_cpu.py) directly.

The Triton ops are registered where Triton imports. Nothing here imports the rest of qrt;
passes find these ops by name.
"""

from . import fp8_block, fp8_cpu, fp8_reference, fp8_static, int_cpu, int_reference  # noqa: F401  (registration)

try:
    from . import fp8_block_triton, fp8_static_triton, fp8_triton, int_triton  # noqa: F401
except ImportError:  # no Triton on this platform: the CPU paths still work
    pass
