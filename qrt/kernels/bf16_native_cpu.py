"""qrt's CPU kernel for dense bf16 linears: `qrt_cpu::bf16_linear` (csrc/dense_bf16_cpu.cpp) on a
weight the loader step packed in pairs, [N, K] -> [N / 64, K / 2, 64, 2].

In that layout one step of the kernel reads the pairs (W[n, 2j], W[n, 2j + 1]) of 64 consecutive
outputs from 256 contiguous bytes and multiplies them with a broadcast pair of x (vdpbf16ps), so
the outputs lie across the lanes and nothing is summed horizontally. The weight keeps its bytes
(the same count as stored), so it replaces oneDNN's prepacked copy rather than adding to it.

Against oneDNN's linear on a prepacked weight, the layout it replaces, it measured 1.4-2.0x at
M = 1 and 0.84-1.92x from M = 2 to 512 on the default model's and the 0.85B Llama's shapes
(`bench/probes/cpu_native_options.py`), and it is called from the compiled graph's C++ wrapper with no
Python in between (oneDNN's carrier goes through a Python custom op, about 28 µs a call).

Numerics: exact bf16 products summed in fp32, one fixed order per output, rounded once to bf16;
as a bf16 GEMM, in another order. A row's result does not depend on the other rows of its batch.
"""

import torch

from . import pair_layout
from .choices import Kernel, declare
from .layouts import NamedLayout
from .pair_layout import output_features


def packable(weight: torch.Tensor) -> bool:
    """Whether this dense weight can be packed in pairs here (bf16 [N, K] on the CPU, N a multiple of
    64, K even, qrt's library built)."""
    return pair_layout.packable(weight, torch.bfloat16)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [N / 64, K / 2, 64, 2], element (b, j, d, t) = weight[64 b + d, 2 j + t]."""
    return torch.ops.qrt_cpu.pack_bf16_pairs(weight.detach().contiguous())


def bf16_pairs_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] bf16; packed: [N / 64, K / 2, 64, 2]; bias: [N] or None -> [..., N] bf16."""
    out = torch.ops.qrt_cpu.bf16_linear(x.reshape(-1, x.shape[-1]), packed, bias)  # [M, N]
    return out.reshape(*x.shape[:-1], output_features(packed))


# Not chosen by a loader pass: prepack_cpu_weights (layers/prepack.py) packs a dense layer's bf16
# weight for this op after the loader pass, where qrt's library is built; oneDNN's prepacked linear
# is the other choice there.
declare(Kernel(
    "qrt_cpu.bf16_linear", devices=("cpu",), serves=(), layout=NamedLayout("bf16 pairs"),
    why="CPU: qrt's AVX-512 kernel on the dense bf16 weight packed in pairs, called from the compiled graph"))
