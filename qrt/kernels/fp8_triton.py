"""Triton kernels for the fp8 (e4m3) linear op: per-token activation quantization and a scaled
fp8 GEMM, fused behind `qrt::fp8_linear_triton`.

`qrt::fp8_linear_triton` has the signature and semantics of `qrt::fp8_linear` (fp8_reference.py),
so the swap pass can replace one node with the other. It runs on CUDA tensors, and on CPU tensors
only under TRITON_INTERPRET=1, which is how the tests exercise it.
"""

import torch
import triton
import triton.language as tl

from qrt.kernels.choices import Kernel, declare
from qrt.kernels.fp8_reference import FP8_CODES, FP8_DTYPE, FP8_MAX, MIN_SCALE
from qrt.kernels.triton_tiles import (check_fp8_operands, check_launchable, flatten_rows, gemm_config, grouped_tile,
                                       output_tiles, round_to_e4m3_grid, row_block, store_tile, unflatten_rows,
                                       wrapped_rows_cols)


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr, q_ptr, scale_ptr,
    K,
    stride_xm, stride_xk, stride_qm,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm

    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # div_rn: Triton's `/` on fp32 is an approximate division on the GPU, and the scale and the
    # codes must match the reference's IEEE division bit for bit.
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)

    # Second pass rereads the row (from L2 for any realistic K) instead of holding it in registers.
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, round_to_e4m3_grid(q).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows, cols = wrapped_rows_cols(offs_m, offs_n, M, N)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N] read from the [N, K] weight: K-major, the operand layout fp8 MMAs want.
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        # Hopper's fp8 MMA accumulates with reduced precision; promoting into the fp32 accumulator
        # after every tile keeps the sum as accurate as the reference's fp32 matmul.
        acc = tl.dot(a, b, acc=acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    a_scale = tl.load(a_scale_ptr + rows)  # [BLOCK_M] fp32, per token
    b_scale = tl.load(b_scale_ptr + cols)  # [BLOCK_N] fp32, per output channel
    # Same order of operations as the reference: (acc * x_scale) * weight_scale + bias.
    out = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    store_tile(c_ptr, out, offs_m, offs_n, M, N, stride_cm, stride_cn)


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization, same results as `quantize_rows_fp8`.

    x: [M, K] bf16/fp16/fp32, any strides. Returns (q [M, K] float8_e4m3fn, scale [M, 1] fp32).
    """
    check_launchable(x, "fp8 kernels", "use qrt::fp8_linear")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)  # [M, K] fp8
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)  # [M, 1] fp32
    _quantize_rows_fp8_kernel[(m,)](
        x, q, scale,
        k,
        x.stride(0), x.stride(1), q.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK_K=row_block(k),
        num_warps=4,
    )
    return q, scale


def fp8_gemm_triton(
    xq: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq @ weight.T) summed in fp32, times x_scale per row and weight_scale per column, plus bias.

    xq: [M, K] fp8; weight: [N, K] fp8; x_scale: [M, 1] fp32; weight_scale: [N] fp32;
    bias: [N] or None. Returns [M, N] in out_dtype.
    """
    check_launchable(xq, "fp8 kernels", "use qrt::fp8_linear")
    m, k = xq.shape
    n = weight.shape[0]
    check_fp8_operands(xq, weight)
    x_scale = x_scale.reshape(-1).contiguous()  # [M] fp32
    weight_scale = weight_scale.reshape(-1).contiguous()  # [N] fp32
    if bias is not None:
        bias = bias.contiguous()  # [N]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)  # [M, N]
    cfg = gemm_config(m)
    grid = (output_tiles(m, n, cfg),)
    fp8_gemm_kernel[grid](
        xq, weight, out, x_scale, weight_scale, bias,
        m, n, k,
        xq.stride(0), xq.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None,
        **cfg,
    )
    return out


@torch.library.custom_op("qrt::fp8_linear_triton", mutates_args=())
def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Triton implementation of `qrt::fp8_linear`.

    x: [..., K] bf16/fp16/fp32; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32;
    bias: [N] or None. Returns [..., N] in x.dtype.
    """
    xq, x_scale = quantize_rows_fp8_triton(flatten_rows(x))  # [M, K] fp8, [M, 1] fp32
    out = fp8_gemm_triton(xq, weight, x_scale, weight_scale, bias, x.dtype)  # [M, N]
    return unflatten_rows(out, x)


@fp8_linear_triton.register_fake
def _(x, weight, weight_scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])

declare(Kernel(
    "qrt.fp8_linear_triton", devices=("cuda",), serves=("qrt.fp8_linear",), replaces="qrt.fp8_linear",
    layout=FP8_CODES, why="fp8 weights on a GPU: Triton fp8 GEMM, fused per-token x per-channel scaling"))
