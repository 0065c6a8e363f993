"""CPU kernels that keep fp8 weights as fp8: `qrt::fp8_linear_native_cpu` (per-channel or
per-tensor scales, activations per token), `qrt::fp8_static_linear_native_cpu` (a static
activation scale) and `qrt::fp8_block_linear_native_cpu` (block scales, activations per group),
each in place of its logical op.

The weights stay e4m3 as stored or quantized (half of bf16's bytes). Each op quantizes its
activations exactly as its reference does, in plain torch that Inductor fuses into one kernel, and
hands the fp8 values and their scales to `qrt_cpu::fp8_gemm` (csrc/quantized_cpu.cpp): below
`MIN_ROWS_DEQUANTIZED` rows a GEMV that widens the fp8 bytes in registers, from there the weight
dequantized to bf16 once per call and oneDNN's GEMM (bench/cpu_native_options.py measured both).

Numerics: the GEMV sums exact products in fp32, so it differs from the reference only in the
summation order; the dequantized route rounds as the widened-weight kernels do (fp8_cpu.py,
fp8_block_cpu.py).
"""

import torch

from . import native_cpu
from .choices import Kernel, declare
from .fp8_block_reference import quantize_groups_fp8
from .fp8_reference import quantize_rows_fp8
from .fp8_static_reference import quantize_static_fp8

# From this many rows on, dequantizing the weight and one bf16 GEMM beat the GEMV
# (bench/cpu_native_options.py; docs/cpu-kernels.md).
MIN_ROWS_DEQUANTIZED = 128

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("fp8_linear_native_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor")
_lib.define("fp8_static_linear_native_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor input_scale, "
            "Tensor? bias) -> Tensor")
_lib.define("fp8_block_linear_native_cpu(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, "
            "int block_n, int block_k) -> Tensor")


def _finish(acc: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """acc [M, N] fp32 -> [..., N] in x's dtype, bias added in fp32."""
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], acc.shape[-1])


def fp8_linear_native_cpu(x, weight, weight_scale, bias):
    """x: [..., K]; weight: [N, K] e4m3; weight_scale: [N] fp32."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    q, x_scale = quantize_rows_fp8(x2)  # [M, K] e4m3, [M, 1] fp32
    n, k = weight.shape
    acc = torch.ops.qrt_cpu.fp8_gemm(q.to(x.dtype), x_scale, weight, weight_scale.reshape(n, 1), 1, k,
                                     MIN_ROWS_DEQUANTIZED)
    return _finish(acc, x, bias)


def fp8_static_linear_native_cpu(x, weight, weight_scale, input_scale, bias):
    """x: [..., K]; weight: [N, K] e4m3; weight_scale: [N] fp32; input_scale: [1] fp32."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    q = quantize_static_fp8(x2, input_scale)  # [M, K] e4m3
    n, k = weight.shape
    x_scale = input_scale.float().reshape(1, 1).expand(x2.shape[0], 1)  # [M, 1]
    acc = torch.ops.qrt_cpu.fp8_gemm(q.to(x.dtype), x_scale, weight, weight_scale.float().reshape(n, 1), 1, k,
                                     MIN_ROWS_DEQUANTIZED)
    return _finish(acc, x, bias)


def fp8_block_linear_native_cpu(x, weight, weight_scale, bias, block_n, block_k):
    """x: [..., K]; weight: [N, K] e4m3; weight_scale: [ceil(N / block_n), ceil(K / block_k)] fp32."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    q, x_scale = quantize_groups_fp8(x2, block_k)  # [M, K] e4m3, [M, ceil(K / block_k)] fp32
    acc = torch.ops.qrt_cpu.fp8_gemm(q.to(x.dtype), x_scale, weight, weight_scale, block_n, block_k,
                                     MIN_ROWS_DEQUANTIZED)
    return _finish(acc, x, bias)


for _name, _fn in (("fp8_linear_native_cpu", fp8_linear_native_cpu),
                   ("fp8_static_linear_native_cpu", fp8_static_linear_native_cpu),
                   ("fp8_block_linear_native_cpu", fp8_block_linear_native_cpu)):
    _lib.impl(_name, _fn, "CompositeImplicitAutograd")

_WHY = "CPU: fp8 weights kept as stored (half of bf16's bytes), widened in registers by qrt's AVX-512 kernel"

for _logical in ("fp8_linear", "fp8_static_linear", "fp8_block_linear"):
    declare(Kernel(
        f"qrt.{_logical}_native_cpu", devices=("cpu",), serves=(f"qrt.{_logical}",), replaces=f"qrt.{_logical}",
        layout="fp8", preference=-10, accepts=lambda **facts: native_cpu.available(), why=_WHY))
