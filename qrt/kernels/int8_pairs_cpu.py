"""qrt's CPU kernel for int8 weight-only linears with one scale per channel:
`qrt_cpu::int8_pairs_linear` (csrc/int8_pairs_cpu.cpp) on the codes packed in pairs,
int8 [N, K] -> [N / 64, K / 2, 64, 2], the layout of the dense bf16 kernel (pair_layout.py).

It is the `int8pack` layout's kernel wherever it can run (bf16 activations, N a multiple of 64,
K even, qrt's library built): `pack_int8_for_cpu` (int_cpu.py) packs the codes this way and
`qrt::int8pack_linear` calls this op on them, at every M. Against `qrt_cpu::int8pack_mm`, the
[N, K] GEMV it replaces, the outputs lie across the vector lanes (no horizontal sums), the channel
scales are read in the model dtype as they are (no per-call conversion) and the activations need
no reordered copy, so a call allocates only its output (bench/probes/cpu_native_options.py).

Numerics: the codes are exact in bf16, their products with x exact in fp32 and summed in fp32 in
one fixed order per output; the scale multiplies the sum once, then one rounding to bf16.
"""

import torch

from . import pair_layout


def packable(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether int8 codes [N, K] for a model in `dtype` can run on this kernel here."""
    return pair_layout.packable(weight, torch.int8, dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N / 64, K / 2, 64, 2], element (b, j, d, t) = weight[64 b + d, 2 j + t]."""
    return pair_layout.pack_in_order(weight)
