"""qrt's CPU kernel for fp8 linears with per-channel (or per-tensor) weight scales:
`qrt_cpu::fp8_pairs_linear` (csrc/fp8_pairs_cpu.cpp) on the e4m3 codes packed in pairs,
[N, K] -> [N / 64, K / 2, 64, 2], the layout of the dense bf16 kernel (pair_layout.py) with the
pairs of each step in the order the kernel's byte unpack produces them.

The activations are quantized to e4m3 inside the op exactly as the reference does (per token, or
with a static scale); the codes are widened by table lookup in registers, and both scales
multiply each output's fp32 sum once. Against `qrt_cpu::fp8_linear`'s GEMV on [N, K] codes, the
outputs lie across the vector lanes (no horizontal sums) and the activations need no reordered,
zero-padded copy (bench/probes/cpu_native_options.py).

Like the bf16 pairs, this layout is made by the loader step for compiled CPU models
(layers/prepack.py), after the loader pass chose `qrt.fp8_linear_native_cpu` or its static
variant: eager models keep [N, K] codes, so eager mode stays the reference. A layer whose weight
is packed calls `linear` below instead of its logical op.

Numerics: as the [N, K] GEMV (exact products summed in fp32, one bf16 rounding), in another fixed
order per output; a row's result does not depend on the other rows of its batch.
"""

import torch

from . import pair_layout
from .choices import Kernel, declare
from .fp8_reference import STATIC_TENSOR, Fp8Weights
from .layouts import Layout, Packed
from .pair_layout import OUTPUTS_PER_BLOCK


def packable(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether e4m3 codes [N, K] of a model in `dtype` can run on this kernel here."""
    return pair_layout.packable(weight, torch.float8_e4m3fn, dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] -> [N / 64, K / 2, 64, 2] in the order of the kernel's byte unpack
    (pair_layout.pack_in_unpack_order)."""
    return pair_layout.pack_in_unpack_order(weight.view(torch.uint8)).view(torch.float8_e4m3fn)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_weight`: [N / 64, K / 2, 64, 2] -> e4m3 [N, K]."""
    return pair_layout.unpack_from_unpack_order(packed.view(torch.uint8)).view(torch.float8_e4m3fn)


def linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] bf16; packed: [N / 64, K / 2, 64, 2] e4m3; weight_scale: fp32 [N] -> [..., N]."""
    out = torch.ops.qrt_cpu.fp8_pairs_linear(x.reshape(-1, x.shape[-1]), packed, weight_scale, bias,
                                             input_scale)  # [M, N]
    return out.reshape(*x.shape[:-1], packed.shape[0] * OUTPUTS_PER_BLOCK)


class Fp8PairsLayout(Layout):
    """The e4m3 codes packed in pairs (above); the scales stay as the loader pass left them."""

    name = "fp8 pairs"

    def pack(self, weights: Fp8Weights, dtype: torch.dtype) -> Packed:
        return Packed({"weight": pack_weight(weights.codes)}, storage="fp8_e4m3 packed in pairs [N / 64, K / 2, 64, 2]")

    def linear(self, layer, x, activation: str, scale_name: str):
        static = layer.input_scale if activation == STATIC_TENSOR else None
        return linear(x, layer.weight, getattr(layer, scale_name), layer.bias, static)


# Not chosen by a loader pass: prepack_cpu_weights (layers/prepack.py) packs the codes of layers
# whose kernel is qrt's fp8 GEMV (per channel or per tensor, dynamic or static activations).
declare(Kernel(
    "qrt_cpu.fp8_pairs_linear", devices=("cpu",), serves=(), layout=Fp8PairsLayout(),
    why="CPU: qrt's AVX-512 kernel on the e4m3 codes packed in pairs, called from the compiled graph"))
