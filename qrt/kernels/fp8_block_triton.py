"""Triton kernels for block fp8 (DeepSeek-V3 / Qwen3-FP8): per-token-group activation quantization
and a block-scaled fp8 GEMM, fused behind `qrt::fp8_block_linear_triton`.

`qrt::fp8_block_linear_triton` has the signature and semantics of `qrt::fp8_block_linear`
(fp8_block_reference.py), so the swap pass can replace one node with the other. Like
fp8_triton.py it runs on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1, which is
how the tests run it.
"""

import torch
import triton
import triton.language as tl

from qrt.kernels.choices import Kernel, declare
from qrt.kernels.fp8_reference import FP8_CODES, FP8_DTYPE, FP8_MAX, MIN_SCALE
from qrt.kernels.triton_tiles import (ROW_BLOCK, check_fp8_operands, check_launchable, flatten_rows, gemm_config,
                                       grouped_tile, output_tiles, round_to_e4m3_grid, store_tile, unflatten_rows,
                                       wrapped_rows_cols)


@triton.jit
def _quantize_groups_fp8_kernel(
    x_ptr, q_ptr, scale_ptr,
    K, NUM_GROUPS,
    stride_xm, stride_xk, stride_qm, stride_sm,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
):
    # A [GROUPS_PER_PROG, BLOCK_G] tile of one row: each tile row is one group (BLOCK_G is GROUP
    # rounded up to a power of two), so the whole group sits in registers and is read once.
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)  # [G_PER_PROG]
    in_group = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    cols = groups[:, None] * GROUP + in_group[None, :]  # [G_PER_PROG, BLOCK_G]
    mask = (in_group[None, :] < GROUP) & (cols < K)

    x = tl.load(x_ptr + row * stride_xm + cols * stride_xk, mask=mask, other=0.0).to(tl.float32)
    # div_rn: Triton's `/` on fp32 is approximate on the GPU; scales and codes must match the
    # reference's IEEE division bit for bit (as in fp8_triton's row quantizer).
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)  # [G_PER_PROG]
    tl.store(scale_ptr + row * stride_sm + groups, scale, mask=groups < NUM_GROUPS)
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_qm + cols, round_to_e4m3_grid(q).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_block_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    HAS_BIAS: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrapped, the rows and columns need no mask for the scale loads either.
    rows, cols = wrapped_rows_cols(offs_m, offs_n, M, N)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N] read from the [N, K] weight: K-major, the operand layout fp8 MMAs want.
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    a_scale_ptrs = a_scale_ptr + rows * stride_asm  # [BLOCK_M], per token
    # [BLOCK_N]: the weight-scale row of each output channel's block.
    b_scale_ptrs = b_scale_ptr + (cols // SCALE_BLOCK_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        # BLOCK_K divides SCALE_BLOCK_K, so the whole tile lies in one scale block along K.
        kb = (k * BLOCK_K) // SCALE_BLOCK_K
        a_scale = tl.load(a_scale_ptrs + kb * stride_ask)  # [BLOCK_M] fp32
        b_scale = tl.load(b_scale_ptrs + kb * stride_bsk)  # [BLOCK_N] fp32
        # Each tile's raw fp8 product is scaled and added into the fp32 accumulator. That is also
        # the promotion Hopper's reduced-precision fp8 MMA accumulation needs, every BLOCK_K <= 128
        # elements (DeepSeek-V3's interval), so the sum is as accurate as the reference's.
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


def quantize_groups_fp8_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row per-group fp8 quantization, same results as `quantize_groups_fp8`.

    x: [M, K] bf16/fp16/fp32, any strides. Returns (q [M, K] float8_e4m3fn,
    scale [M, ceil(K / group)] fp32).
    """
    check_launchable(x, "fp8 kernels", "use qrt::fp8_block_linear")
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)  # [M, K] fp8
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)  # [M, G] fp32
    block_g = triton.next_power_of_2(group)
    # One program covers whole groups of one row, ROW_BLOCK elements of them (8 groups of 128): the
    # same 16-byte loads per lane as the row quantizers.
    groups_per_prog = min(max(ROW_BLOCK // block_g, 1), triton.next_power_of_2(num_groups))
    grid = (m, triton.cdiv(num_groups, groups_per_prog))
    _quantize_groups_fp8_kernel[grid](
        x, q, scale,
        k, num_groups,
        x.stride(0), x.stride(1), q.stride(0), scale.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        GROUP=group, BLOCK_G=block_g, GROUPS_PER_PROG=groups_per_prog,
        num_warps=4,
    )
    return q, scale


def fp8_block_gemm_triton(
    xq: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """sum over K blocks of (xq @ weight.T)[block] * x_scale[m, kb] * weight_scale[n // block_n, kb],
    summed in fp32, plus bias.

    xq: [M, K] fp8; weight: [N, K] fp8; x_scale: [M, ceil(K / block_k)] fp32;
    weight_scale: [ceil(N / block_n), ceil(K / block_k)] fp32; bias: [N] or None.
    Returns [M, N] in out_dtype. block_k must be a multiple of 16 (the K tile divides it and
    tl.dot needs K >= 16).
    """
    check_launchable(xq, "fp8 kernels", "use qrt::fp8_block_linear")
    m, k = xq.shape
    n = weight.shape[0]
    check_fp8_operands(xq, weight)
    x_scale_shape = (m, triton.cdiv(k, block_k))
    w_scale_shape = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    if tuple(x_scale.shape) != x_scale_shape or tuple(weight_scale.shape) != w_scale_shape:
        raise ValueError(
            f"block fp8 GEMM: M={m}, N={n}, K={k}, blocks {block_n}x{block_k} need scales "
            f"{x_scale_shape} and {w_scale_shape}, got {tuple(x_scale.shape)} and {tuple(weight_scale.shape)}"
        )
    if block_k % 16:
        raise ValueError(f"block fp8 GEMM: block_k={block_k} is not a multiple of 16")
    cfg = gemm_config(m)
    # The largest power of two dividing block_k, capped by the tile size chosen for m: each K
    # tile then lies in a single scale block (128 for the checkpoints in use).
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], block_k & -block_k)
    if bias is not None:
        bias = bias.contiguous()  # [N]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)  # [M, N]
    grid = (output_tiles(m, n, cfg),)
    fp8_block_gemm_kernel[grid](
        xq, weight, out, x_scale, weight_scale, bias,
        m, n, k,
        xq.stride(0), xq.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        x_scale.stride(0), x_scale.stride(1), weight_scale.stride(0), weight_scale.stride(1),
        HAS_BIAS=bias is not None, SCALE_BLOCK_N=block_n, SCALE_BLOCK_K=block_k,
        **cfg,
    )
    return out


@torch.library.custom_op("qrt::fp8_block_linear_triton", mutates_args=())
def fp8_block_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """Triton implementation of `qrt::fp8_block_linear`.

    x: [..., K] bf16/fp16/fp32; weight: [N, K] float8_e4m3fn;
    weight_scale: [ceil(N / block_n), ceil(K / block_k)] fp32; bias: [N] or None.
    Returns [..., N] in x.dtype.
    """
    xq, x_scale = quantize_groups_fp8_triton(flatten_rows(x), block_k)  # [M, K] fp8, [M, G] fp32
    out = fp8_block_gemm_triton(xq, weight, x_scale, weight_scale, bias, block_n, block_k, x.dtype)
    return unflatten_rows(out, x)  # [..., N]


@fp8_block_linear_triton.register_fake
def _(x, weight, weight_scale, bias, block_n, block_k):
    return x.new_empty(*x.shape[:-1], weight.shape[0])

declare(Kernel(
    "qrt.fp8_block_linear_triton", devices=("cuda",), serves=("qrt.fp8_block_linear",),
    replaces="qrt.fp8_block_linear", layout=FP8_CODES,
    why="block fp8 on a GPU: Triton GEMM with per-block weight and per-group activation scales"))
