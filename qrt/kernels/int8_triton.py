"""Triton kernels for W8A8 linears: int8 activation quantization (dynamic per token, symmetric or
asymmetric, or static per tensor) and an int8 x int8 -> int32 GEMM whose epilogue applies the
zero-point correction, the per-token x per-channel rescale and the bias.

- `qrt::int8_linear_triton`: same signature and semantics as `qrt::int8_linear`
  (int8_reference.py), so the swap pass can put one in place of the other;
- `qrt::int8_gemm_triton`: the GEMM alone, for activations an earlier fused kernel already
  quantized (symmetric, per token; the fuse_act_quant pass emits it).

They run on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1 (the tests).
"""

import torch
import triton
import triton.language as tl

from .activation_reference import int8_input_fusions
from .choices import Kernel, declare
from .int8_reference import INT8_ROWS, MIN_SCALE, check_activation_scheme
from .triton_tiles import (check_launchable, flatten_rows, gemm_config, grouped_tile, output_tiles, round_half_even,
                           row_block, store_tile, unflatten_rows, wrapped_rows_cols)


@triton.jit
def _quantize_rows_int8_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, static_scale_ptr, static_zero_ptr,
    K,
    stride_xm, stride_xk, stride_qm,
    STATIC: tl.constexpr, ASYMMETRIC: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
        if ASYMMETRIC:
            zero = tl.load(static_zero_ptr).to(tl.float32)
        else:
            zero = 0.0
    else:
        # Masked lanes read 0, which never changes the result: the range always includes 0.
        low = tl.zeros((BLOCK_K,), dtype=tl.float32)
        high = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32)
            low = tl.minimum(low, x)
            high = tl.maximum(high, x)
        # div_rn: Triton's fp32 `/` is approximate on the GPU; the scale and codes must match the
        # reference's IEEE division.
        if ASYMMETRIC:
            low_all = tl.min(low, axis=0)
            scale = tl.maximum(tl.div_rn(tl.max(high, axis=0) - low_all, 255.0), MIN_SCALE)
            zero = tl.clamp(round_half_even(-128.0 - tl.div_rn(low_all, scale)), -128.0, 127.0)
        else:
            amax = tl.maximum(tl.max(high, axis=0), -tl.min(low, axis=0))
            scale = tl.maximum(tl.div_rn(amax, 127.0), MIN_SCALE)
            zero = 0.0
        tl.store(scale_ptr + row, scale)
        if ASYMMETRIC:
            tl.store(zero_ptr + row, zero.to(tl.int32))

    q_row = q_ptr + row * stride_qm
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        # A static scale can leave values far outside the grid; past ±1024 every code saturates
        # anyway, and the bound keeps round_half_even in its range.
        v = round_half_even(tl.clamp(tl.div_rn(x, scale), -1024.0, 1024.0)) + zero
        tl.store(q_row + offs, tl.clamp(v, -128.0, 127.0).to(tl.int8), mask=mask)


def quantize_activations_int8_triton(x2, input_scale, input_zero_point, asymmetric: bool):
    """Same results as `quantize_activations_int8` (int8_reference.py).

    x2: [M, K] bf16/fp16/fp32. Returns (q [M, K] int8, scale [M, 1] fp32, zero [M, 1] int32 or None)."""
    check_launchable(x2, "int8 kernels", "use qrt::int8_linear")
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x2.device)  # [M, K]
    static = input_scale is not None
    if static:
        scale = input_scale.float().reshape(1, 1).expand(m, 1)  # [M, 1], one value
        zero = None if input_zero_point is None else input_zero_point.to(torch.int32).reshape(1, 1).expand(m, 1)
    else:
        scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)  # [M, 1]
        zero = torch.empty((m, 1), dtype=torch.int32, device=x2.device) if asymmetric else None  # [M, 1]
    _quantize_rows_int8_kernel[(m,)](
        x2, q, scale, zero,
        input_scale.float().contiguous() if static else None,
        input_zero_point.to(torch.int32).contiguous() if static and zero is not None else None,
        k,
        x2.stride(0), x2.stride(1), q.stride(0),
        STATIC=static, ASYMMETRIC=zero is not None, MIN_SCALE=MIN_SCALE,
        BLOCK_K=row_block(k), num_warps=4,
    )
    return q, scale, zero


@triton.jit
def int8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, a_zero_ptr, b_scale_ptr, b_sums_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_sm,
    ASYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows, cols = wrapped_rows_cols(offs_m, offs_n, M, N)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N] of [N, K]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
        acc = tl.dot(a, b, acc=acc, out_dtype=tl.int32)  # exact integer sums
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if ASYMMETRIC:
        # The zero-point correction, in integers: Σ (q - z) q_w = Σ q q_w - z Σ q_w.
        zero = tl.load(a_zero_ptr + rows * stride_sm)  # [BLOCK_M] int32
        sums = tl.load(b_sums_ptr + cols)  # [BLOCK_N] int32
        acc -= zero[:, None] * sums[None, :]
    a_scale = tl.load(a_scale_ptr + rows * stride_sm)  # [BLOCK_M] fp32, per token
    b_scale = tl.load(b_scale_ptr + cols)  # [BLOCK_N] fp32, per output channel
    # The reference's order: (acc * x_scale) * weight_scale + bias.
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    store_tile(c_ptr, out, offs_m, offs_n, M, N, stride_cm, stride_cn)


def int8_gemm_triton(xq, x_scale, x_zero, weight, weight_scale, weight_sums, bias, out_dtype) -> torch.Tensor:
    """(xq @ weight.T - x_zero * weight_sums) * x_scale * weight_scale + bias.

    xq: int8 [M, K]; x_scale: fp32 [M, 1]; x_zero: int32 [M, 1] or None; weight: int8 [N, K];
    weight_scale: fp32 [N]; weight_sums: int32 [N] (with x_zero); bias: [N] or None.
    Returns [M, N] in out_dtype."""
    check_launchable(xq, "int8 kernels", "use qrt::int8_linear")
    m, k = xq.shape
    n = weight.shape[0]
    if xq.dtype != torch.int8 or weight.dtype != torch.int8 or weight.shape[1] != k:
        raise ValueError(f"int8 GEMM takes int8 [M, K] x int8 [N, K]; got {xq.dtype} {tuple(xq.shape)} and "
                         f"{weight.dtype} {tuple(weight.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)  # [M, N]
    cfg = gemm_config(m)
    grid = (output_tiles(m, n, cfg),)
    # x_scale / x_zero may be a broadcast [M, 1] view of one static value: stride_sm 0 reads it.
    int8_gemm_kernel[grid](
        xq, weight, out, x_scale, x_zero, weight_scale.float().contiguous(),
        None if x_zero is None else weight_sums.to(torch.int32).contiguous(),
        None if bias is None else bias.contiguous(),
        m, n, k,
        xq.stride(0), xq.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        x_scale.stride(0),
        ASYMMETRIC=x_zero is not None, HAS_BIAS=bias is not None,
        **cfg,
    )
    return out


@torch.library.custom_op("qrt::int8_linear_triton", mutates_args=())
def int8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    input_zero_point: torch.Tensor | None,
    weight_sums: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Triton implementation of `qrt::int8_linear`. x: [..., K]; returns [..., N] in x.dtype."""
    check_activation_scheme(input_scale, input_zero_point, weight_sums)
    xq, x_scale, x_zero = quantize_activations_int8_triton(flatten_rows(x), input_scale, input_zero_point,
                                                          weight_sums is not None)
    out = int8_gemm_triton(xq, x_scale, x_zero, weight, weight_scale, weight_sums, bias, x.dtype)  # [M, N]
    return unflatten_rows(out, x)


@int8_linear_triton.register_fake
def _(x, weight, weight_scale, input_scale, input_zero_point, weight_sums, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qrt::int8_gemm_triton", mutates_args=())
def int8_gemm_op(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The symmetric W8A8 GEMM on activations already quantized per token.

    xq: int8 [..., K]; x_scale: fp32 [..., 1]. Returns [..., N] in out_dtype."""
    out = int8_gemm_triton(flatten_rows(xq), x_scale.reshape(-1, 1), None, weight, weight_scale, None, bias,
                           out_dtype)
    return unflatten_rows(out, xq)


@int8_gemm_op.register_fake
def _(xq, x_scale, weight, weight_scale, bias, out_dtype):
    return xq.new_empty(*xq.shape[:-1], weight.shape[0], dtype=out_dtype)


def _int8_gemm_args(args):
    """int8_linear_triton(x, weight, weight_scale, input_scale, input_zero_point, weight_sums, bias) ->
    int8_gemm_triton's weight-side args; only dynamic symmetric activations arrive quantized that way."""
    _, weight, weight_scale, input_scale, input_zero_point, weight_sums, bias = args
    return None if any(a is not None for a in (input_scale, input_zero_point, weight_sums)) else (
        weight, weight_scale, bias)


declare(Kernel(
    "qrt.int8_linear_triton", devices=("cuda",), serves=("qrt.int8_linear",), replaces="qrt.int8_linear",
    layout=INT8_ROWS, fusions=int8_input_fusions("qrt.int8_gemm_triton", _int8_gemm_args),
    why="W8A8 on a GPU: Triton per-token int8 quantization, int8 GEMM with the rescale and zero-point correction "
        "in its epilogue"))
