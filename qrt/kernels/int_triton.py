"""Triton GEMM for integer weight-only linears (W4A16, W8A16, W2A16), behind
`qrt::int_linear_triton`.

Same signature and semantics as `qrt::int_linear` (int_reference.py), on the canonical layout:
packed int32 words along K, group scales and zero points, optional act-order permutation. The
weight tile is unpacked and dequantized in registers, so the weight crosses memory at its packed
size: the point of W4A16 at decode, where the GEMM is a weight-streaming GEMV.

Decode shapes (M <= 16) split K across programs (split-K) so that a 4096-wide weight still spreads
over every SM; the partial sums are written to an fp32 buffer and reduced by one torch sum, which
keeps results deterministic (no atomics).
"""

import torch
import triton
import triton.language as tl

from .choices import Kernel, declare
from .int_reference import CANONICAL_INT, pack_factor
from .triton_tiles import (check_launchable, flatten_rows, grouped_tile, load_packed_codes, output_tiles, store_tile,
                           unflatten_rows, wrapped_rows_cols)

# Enough programs to cover ~2 waves on a 132-SM GPU before split-K stops adding splits.
_TARGET_PROGRAMS = 264
_MAX_SPLIT_K = 16


@triton.jit
def int_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    BITS: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows, cols = wrapped_rows_cols(offs_m, offs_n, M, N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        q = load_packed_codes(qw_ptr, offs_k, cols, in_k, stride_qk, stride_qn, BITS)  # [BLOCK_K, BLOCK_N]
        group = (offs_k // group_size).to(tl.int64)
        # Scales and zeros each by their own strides: a loader may hand over either one transposed.
        scale = tl.load(s_ptr + group[:, None] * stride_sg + cols[None, :] * stride_sn,
                        mask=in_k[:, None], other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group[:, None] * stride_zg + cols[None, :] * stride_zn,
                       mask=in_k[:, None], other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - zero) * scale  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc=acc)

    store_tile(out_ptr + split * stride_os, acc, offs_m, offs_n, M, N, stride_om, stride_on)  # this split's sums


def gemm_tiles(m: int, n: int, k: int, fp32: bool = False) -> dict:
    """Tiles, pipelining and split-K for an [m, K] x [K, N] weight-only GEMM; `fp32`: fp32 activations.

    Each pipeline stage holds the codes, scales and zero points per (k, n) as well as the
    activations, and a Hopper SM has 227 KiB of shared memory: 3 stages fit with bf16/fp16
    activations (212-224 KiB with fp32 scales and zeros), 2 with fp32 ones (at 3 they ask for
    240-288 KiB). tests/test_triton_shared_memory.py compiles every configuration for sm_90."""
    stages = 2 if fp32 else 3
    if m <= 16:
        # Decode: the smallest tile tl.dot takes along M; the kernel streams the weight.
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=stages)
    elif m <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=stages)
    else:
        # Prefill: compute-bound; large tiles, dequantization amortised over 128 rows.
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=stages)
    tiles = output_tiles(m, n, cfg)
    k_blocks = triton.cdiv(k, cfg["BLOCK_K"])
    cfg["SPLIT_K"] = max(1, min(_TARGET_PROGRAMS // tiles, k_blocks, _MAX_SPLIT_K))
    return cfg


def int_gemm_triton(x2, qweight, scales, zeros, bits: int, group_size: int) -> torch.Tensor:
    """x2: [M, K] bf16/fp16/fp32 (already permuted) times the dequantized canonical weight.
    Returns [M, N] fp32 when split-K is used, else in x2's dtype."""
    check_launchable(x2, "integer GEMM", "use qrt::int_linear")
    m, k = x2.shape
    n = qweight.shape[1]
    if qweight.shape[0] != -(-k // pack_factor(bits)):
        raise ValueError(f"int GEMM: activations have K={k}, but a {bits}-bit qweight of shape "
                         f"{tuple(qweight.shape)} holds {qweight.shape[0] * pack_factor(bits)} rows")
    cfg = gemm_tiles(m, n, k, fp32=x2.dtype == torch.float32)
    split_k = cfg["SPLIT_K"]
    out_dtype = torch.float32 if split_k > 1 else x2.dtype
    out = torch.empty((split_k, m, n), dtype=out_dtype, device=x2.device)  # [SPLIT_K, M, N] partial sums
    grid = (output_tiles(m, n, cfg), split_k)
    int_gemm_kernel[grid](
        x2, qweight, scales, zeros, out,
        m, n, k, group_size,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1), out.stride(0), out.stride(1), out.stride(2),
        # fp32 activations get an exact fp32 dot, not TF32. Triton's interpreter multiplies bf16
        # operands wrongly (Triton 3.7), so there the dot is done in fp32 as well.
        BITS=bits, FP32_DOT=x2.dtype == torch.float32 or triton.knobs.runtime.interpret,
        **cfg,
    )
    return out[0] if split_k == 1 else out.sum(dim=0)


@torch.library.custom_op("qrt::int_linear_triton", mutates_args=())
def int_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """Triton implementation of `qrt::int_linear`. x: [..., K]; returns [..., N] in x.dtype."""
    x2 = flatten_rows(x)  # [M, K]
    if perm is not None:
        x2 = x2.index_select(1, perm)
    out = int_gemm_triton(x2, qweight, scales, zeros, bits, group_size)  # [M, N]
    if bias is not None:
        out = out.float() + bias.float()
    return unflatten_rows(out.to(x.dtype), x)


@int_linear_triton.register_fake
def _(x, qweight, scales, zeros, perm, bias, bits, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[1])

declare(Kernel(
    "qrt.int_linear_triton", devices=("cuda",), serves=("qrt.int_linear",), replaces="qrt.int_linear",
    layout=CANONICAL_INT, accepts=lambda bits, group_size, k, n, contiguous_groups: contiguous_groups,
    why="integer weights on a GPU: Triton GEMM unpacking and dequantizing the weight tile in registers"))
