"""CPU dense GEMM on weights that the loader pass prepacked for oneDNN: `qrt::onednn_linear`.

Inductor prepacks weights for oneDNN only when they are frozen into the graph as constants, and
frozen graphs can neither be compiled once per decoder layer (inside a nested compile region the
weights are inputs) nor be cached (AOTAutograd refuses frozen graphs, the FX graph cache refuses
mkldnn constants). So qrt prepacks in its loader pass instead and keeps the packed tensor out of
the graph: the layer's parameter becomes a *carrier*, a zero-stride view of one element with the
weight's shape and dtype, and the packed tensor sits in a side table keyed by the carrier's
storage. The graph, its fake tensors and its cache entries see only the carrier; the opaque op
looks the packed weight up when it runs.

At M = 1 a decode step's GEMMs on prepacked weights take about two thirds of the time of `F.linear`
on the same bf16 weights, which reorders them on every call (`bench/probes/cpu_bf16_gemm_options.py`;
`bench/startup.py` measures the whole decode).

Kernels whose GEMM goes through `dense_linear` take either form of weight, and say so in their
declaration (`prepackable`); the loader prepacks only the weights of those.
"""

import weakref

import torch
import torch.nn.functional as F

from .bf16_native_cpu import bf16_pairs_linear
from .widened_cpu import cpu_has_bf16_arithmetic, widens
from .pair_layout import is_pair_packed
from .choices import Kernel, declare
from .layouts import Layout, NamedLayout, Packed

# carrier storage address -> oneDNN-packed weight [N, K]; an entry lives as long as its carrier
_PACKED: dict[int, torch.Tensor] = {}


def onednn_prepack_supported(dtype: torch.dtype) -> bool:
    """oneDNN's packed bf16 linear needs the CPU's bf16 instructions (AVX-512 BF16 or AMX)."""
    return dtype == torch.bfloat16 and cpu_has_bf16_arithmetic()


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> carrier [N, K] (strides (0, 0), one element of storage); the packed copy
    is kept until the carrier is freed. The caller holds the carrier (as a parameter) instead of
    the weight, so the dense weight can be freed."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # mkldnn layout [N, K]
    carrier = weight.new_zeros(1).expand(weight.shape)  # [N, K], strides (0, 0)
    address = carrier.data_ptr()
    _PACKED[address] = packed
    weakref.finalize(carrier.untyped_storage(), _PACKED.pop, address, None)
    return carrier


def prepack_stacked_weights(weights: torch.Tensor) -> torch.Tensor:
    """weights [E, N, K] (a block's experts) -> carrier [E, N, K] (strides (1, 0, 0), E elements
    of storage) whose slice [e] is expert e's carrier: each slice starts at an address of its own,
    under which its packed weight is kept."""
    carrier = weights.new_zeros(weights.shape[0])[:, None, None].expand(weights.shape)  # [E, N, K]
    for expert in range(weights.shape[0]):
        _PACKED[carrier[expert].data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(weights[expert].detach(), None)
    weakref.finalize(carrier.untyped_storage(), _forget, [carrier[e].data_ptr() for e in range(weights.shape[0])])
    return carrier


def _forget(addresses: list[int]) -> None:
    for address in addresses:
        _PACKED.pop(address, None)


def is_prepacked(weight: torch.Tensor) -> bool:
    """True for a carrier made by `prepack_weight`: a static property of the tensor (its strides),
    so inside a traced graph this is decided once, at trace time."""
    return weight.dim() == 2 and weight.stride() == (0, 0) and weight.numel() > 1


@torch.library.custom_op("qrt::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, carrier: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., K] bf16; carrier: [N, K] from `prepack_weight`; bias: [N] or None -> [..., N]."""
    try:
        packed = _PACKED[carrier.data_ptr()]
    except KeyError:
        raise RuntimeError("qrt::onednn_linear got a weight that was not prepacked by qrt's loader pass "
                           "(or whose packed copy was freed)") from None
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, carrier, bias):
    return x.new_empty(*x.shape[:-1], carrier.shape[0])


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ (+ b) for a dense weight [N, K], a prepacked carrier of one, or one packed in pairs for
    qrt's bf16 kernel (bf16_native_cpu.py); many rows of bf16 or fp16 in float32 on CPUs without
    bf16 arithmetic (widened_cpu.py)."""
    if is_pair_packed(weight):
        return bf16_pairs_linear(x, weight, bias)
    if is_prepacked(weight):
        return torch.ops.qrt.onednn_linear(x, weight, bias)
    product = torch.ops.qrt.widened_linear(x, weight) if widens(x, weight) else F.linear(x, weight)
    if bias is None:
        return product
    # The bias added apart: inside a nested compile region, torch 2.13 replays F.linear with a
    # bias under functionalization through a path that reads the input's sizes as ints, which
    # turns a dynamic sequence length into a constant (a ConstraintViolationError).
    return product + bias


class DenseLayout(Layout):
    """The weight [N, K] in the model dtype: as stored, or dequantized from any neutral form of
    weights that can dequantize itself (the fallback where no quantized kernel takes them)."""

    name = "dense"

    def pack(self, weights, dtype: torch.dtype) -> Packed:
        # Row-major [N, K]: a neutral form may dequantize to a transposed view ([K, N] in memory),
        # which ATen's bf16 GEMM on a CPU without AVX-512 multiplies 25x slower than [N, K] (an
        # output layer of 49152 x 576 at one row: 405 ms against 16).
        return Packed({"weight": weights.dequantize().to(dtype).contiguous()},  # [N, K]
                      storage=f"{str(dtype).removeprefix('torch.')} [N, K] dequantized: no quantized kernel here "
                              f"takes these weights")

    def linear(self, layer, x, *settings):
        return dense_linear(x, layer.weight, layer.bias)


DENSE = DenseLayout()

declare(Kernel(
    "aten.linear", devices=("cpu", "cuda"), serves=("aten.linear", "qrt.int_linear"), layout=DENSE, preference=100,
    prepackable=True, why="a dense GEMM in the model dtype: weights as stored, or dequantized where no quantized "
                          "kernel runs them"))
# Not chosen by a loader pass: prepack_cpu_weights (layers/prepack.py) turns a prepackable layer's
# dense weight into a carrier for this op after the loader pass.
declare(Kernel(
    "qrt.onednn_linear", devices=("cpu",), serves=(), layout=NamedLayout("prepacked"),
    why="CPU: the loader prepacked the dense weights for oneDNN's linear"))
