"""CPU kernel of block fp8, `qrt::fp8_block_linear_cpu`, in place of the logical op
`qrt::fp8_block_linear` (fp8_block_reference.py). Like fp8_cpu.py it is CompositeImplicitAutograd,
so under torch.compile AOTAutograd decomposes it into aten ops and Inductor fuses the activation
fake-quantization around the GEMM.

Its `weight` is not fp8: the loader pass has already replaced it with
`dequantize_block_fp8(weight, weight_scale, block_n, block_k, model_dtype)`, because the block
scales vary along K and so cannot be applied after a single GEMM. `weight_scale` is then unused;
it stays in the signature so the swap pass can replace `qrt::fp8_block_linear` 1:1.

A ragged K (not a multiple of block_k; no checkpoint in use has one) gets a second GEMM for the
last, partial group rather than one fake-quantized [M, K] tensor, so that every pointwise kernel
spans whole groups. That keeps clear of an Inductor CPU bug (torch 2.13): its loop split turns
the extent K of a kernel indexed by k // group into K // group * group and leaves the tail
columns unwritten (pytorch/pytorch#195582, fix proposed in #196119); a zero-padded
[M, G, group] view sliced back to K, or scales expanded and sliced to K, hit it.

Numerics: the activations are rounded to fp8 per group exactly as `quantize_groups_fp8` does.
In fp32 the weight and the dequantized activations equal the reference's, so only the summation
order differs; in bf16 both GEMM operands carry one extra bf16 rounding (2**-9 relative), and
the GEMM output one more.
"""

import torch
import torch.nn.functional as F

from .choices import Kernel, declare
from .fp8_block_reference import dequantize_block_fp8, group_spans, quantize_whole_groups
from .fp8_reference import Fp8Weights, fp8_logical_linear
from .layouts import Layout, Packed

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define(
    "fp8_block_linear_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, "
    "int block_n, int block_k) -> Tensor"
)


def fp8_block_linear_cpu(x, weight, weight_scale, bias, block_n, block_k):
    """x: [..., K]; weight: [N, K] dequantized in the model dtype; weight_scale: unused."""
    k = x.shape[-1]
    x32 = x.reshape(-1, k).float()  # [M, K]
    out = None
    for start, width, group in group_spans(k, block_k):
        q, scale = quantize_whole_groups(x32[:, start : start + width], group)
        x_deq = (q.float() * scale[..., None]).flatten(1).to(weight.dtype)  # [M, width]
        part = F.linear(x_deq, weight[:, start : start + width]).float()  # [M, N] fp32
        out = part if out is None else out + part
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


_lib.impl("fp8_block_linear_cpu", fp8_block_linear_cpu, "CompositeImplicitAutograd")


class DequantizedBlockLayout(Layout):
    """The block fp8 weight dequantized (codes × block scale, rounded once to the model dtype),
    [N, K]. The scale grid becomes ones, so the reference op, which multiplies the two, still
    computes the same weight when a model runs eagerly."""

    name = "dequantized"

    def pack(self, weights: Fp8Weights, dtype: torch.dtype) -> Packed:
        w = weights
        return Packed({"weight": dequantize_block_fp8(w.codes, w.scale, *w.block, dtype),  # [N, K]
                       w.scale_name: torch.ones_like(w.scale)},  # [N / bn, K / bk]
                      storage=f"{str(dtype).removeprefix('torch.')} [N, K] dequantized with block scales")

    def linear(self, layer, x, activation: str, scale_name: str):
        return fp8_logical_linear(layer, x, activation, scale_name)

declare(Kernel(
    "qrt.fp8_block_linear_cpu", devices=("cpu",), serves=("qrt.fp8_block_linear",), replaces="qrt.fp8_block_linear",
    layout=DequantizedBlockLayout(),
    why="CPU: the loader pass dequantized the blocks (fp8 x block scale, rounded once); Inductor fuses the "
        "per-group activation quantization around one GEMM"))
