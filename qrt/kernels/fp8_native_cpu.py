"""CPU kernels that keep fp8 weights as fp8: `qrt::fp8_linear_native_cpu` (per-channel or
per-tensor scales, activations per token), `qrt::fp8_static_linear_native_cpu` (a static
activation scale) and `qrt::fp8_block_linear_native_cpu` (block scales, activations per group),
each in place of its logical op.

The weights stay e4m3 as stored or quantized (half of bf16's bytes). Each op is one call of
`qrt_cpu::fp8_linear` (csrc/quantized_cpu.cpp), which quantizes the activations exactly as the
reference does (per token, per group of block_k, or with the static scale; AVX-512, where
Inductor's fp8 conversion is one element at a time) and then, below `MIN_ROWS_DEQUANTIZED` rows,
runs a GEMV that widens the fp8 bytes in registers, and from there dequantizes the weight tile
by tile to bf16 for oneDNN's GEMM (bench/probes/cpu_native_options.py measured both).

Numerics: the GEMV sums exact products in fp32, so it differs from the reference only in the
summation order and the output's rounding; the dequantized route rounds as the widened-weight
kernels do (fp8_cpu.py, fp8_block_cpu.py): a bf16 GEMM output, and for blocks both operands
dequantized to bf16.
"""

import torch

from . import native_cpu
from .choices import Kernel, declare
from .fp8_reference import FP8_CODES

# From this many rows on, dequantizing the weight and bf16 GEMMs beat the GEMV
# (bench/probes/cpu_native_options.py; docs/cpu-kernels.md).
MIN_ROWS_DEQUANTIZED = 128

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("fp8_linear_native_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor")
_lib.define("fp8_static_linear_native_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor input_scale, "
            "Tensor? bias) -> Tensor")
_lib.define("fp8_block_linear_native_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, "
            "int block_n, int block_k) -> Tensor")


def _run(x, weight, weight_scale, bias, block_n: int, block_k: int, input_scale=None):
    """x: [..., K] -> [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    out = torch.ops.qrt_cpu.fp8_linear(x2, weight, weight_scale, bias, block_n, block_k, input_scale,
                                       MIN_ROWS_DEQUANTIZED)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_native_cpu(x, weight, weight_scale, bias):
    """x: [..., K]; weight: [N, K] e4m3; weight_scale: [N] fp32; activations quantized per token."""
    n, k = weight.shape
    return _run(x, weight, weight_scale.float().reshape(n, 1), bias, 1, k)


def fp8_static_linear_native_cpu(x, weight, weight_scale, input_scale, bias):
    """x: [..., K]; weight: [N, K] e4m3; weight_scale: [N] fp32; input_scale: [1] fp32."""
    n, k = weight.shape
    return _run(x, weight, weight_scale.float().reshape(n, 1), bias, 1, k, input_scale)


def fp8_block_linear_native_cpu(x, weight, weight_scale, bias, block_n, block_k):
    """x: [..., K]; weight: [N, K] e4m3; weight_scale: [ceil(N / block_n), ceil(K / block_k)] fp32."""
    return _run(x, weight, weight_scale.float(), bias, block_n, block_k)


for _name, _fn in (("fp8_linear_native_cpu", fp8_linear_native_cpu),
                   ("fp8_static_linear_native_cpu", fp8_static_linear_native_cpu),
                   ("fp8_block_linear_native_cpu", fp8_block_linear_native_cpu)):
    _lib.impl(_name, _fn, "CompositeImplicitAutograd")

_WHY = "CPU: fp8 weights kept as stored (half of bf16's bytes), widened in registers by qrt's AVX-512 kernel"

for _logical in ("fp8_linear", "fp8_static_linear", "fp8_block_linear"):
    declare(Kernel(
        f"qrt.{_logical}_native_cpu", devices=("cpu",), serves=(f"qrt.{_logical}",), replaces=f"qrt.{_logical}",
        layout=FP8_CODES, preference=-10, accepts=lambda **facts: native_cpu.available(), why=_WHY))
