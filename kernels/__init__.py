"""Kernels, registered as torch custom ops under the `qrt` namespace.

Each scheme has a logical op that quantized layers call, whose implementation is the plain-torch
reference (so eager mode is the oracle), and kernel ops the swap pass puts in its place:

| logical op (reference)                      | CPU kernel              | GPU kernel (Triton)        |
|---------------------------------------------|-------------------------|----------------------------|
| `qrt::fp8_linear` (per-token activations)   | `fp8_linear_cpu`        | `fp8_linear_triton`        |
| `qrt::fp8_static_linear` (static scale)     | `fp8_static_linear_cpu` | `fp8_static_linear_triton` |
| `qrt::fp8_block_linear` (block weights)     | `fp8_block_linear_cpu`  | `fp8_block_linear_triton`  |
| `qrt::int_linear` (int weight-only)         | see below               | `int_linear_triton`        |
| `qrt::int8_linear` (W8A8: int8 activations) | `int8_linear_cpu`       | `int8_linear_triton`       |
| `qrt::w4a8_linear` (QQQ: 4-bit weights)     | see below               | `w4a8_linear_triton`       |

A family's files are named for what they hold: `<family>_reference.py` the logical op and its
plain-torch reference, `<family>_cpu.py` the CPU kernel ops, `<family>_triton.py` the Triton
kernel ops (fp8_block_reference.py, fp8_block_cpu.py, fp8_block_triton.py, ...).

On the CPU, integer weight-only layers are packed by the loader pass into the opaque layouts of
ATen's int matmuls and call `int4pack_linear` / `int8pack_linear` (int_cpu.py) directly. QQQ
layers on the CPU get the int8 weights their 4-bit codes stand for and run as W8A8.

On the CPU, dense bf16 GEMMs (unquantized layers, fp8 weights widened to bf16) run on weights the
loader pass prepacked for oneDNN, through `onednn_linear` (onednn_cpu.py).

On CUDA, the fuse_act_quant pass further splits a W8A8/W4A8 kernel whose input comes from an
RMSNorm or from SiLU-and-mul into `rms_norm_quant_int8_triton` / `silu_mul_quant_int8_triton`
(the normalization or activation and the per-token int8 quantization in one kernel) followed by
`int8_gemm_triton` / `w4a8_gemm_triton`, which take activations already quantized.

The Triton files share their tile order, GEMM tile sizes, edge handling, rounding helpers and
launch checks through triton_tiles.py. The Triton ops are registered where Triton imports.
Nothing here imports the rest of qrt; passes find these ops by name.
"""

from . import (fp8_block_cpu, fp8_block_reference, fp8_cpu, fp8_reference, fp8_static_cpu,  # noqa: F401
               fp8_static_reference, int8_cpu, int8_reference, int_cpu, int_reference, onednn_cpu, w4a8_reference)

try:
    from . import (fp8_block_triton, fp8_static_triton, fp8_triton, int8_fused_triton, int8_triton,  # noqa: F401
                   int_triton, w4a8_triton)
except ImportError:  # no Triton on this platform: the CPU paths still work
    pass
