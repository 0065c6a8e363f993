"""Triton W4A8 GEMM (QQQ): int8 per-token activations times 4-bit weights that are unpacked and
turned into int8 in registers, int32 accumulation, per-token x per-channel rescale in the epilogue.

- `qrt::w4a8_linear_triton`: same signature and semantics as `qrt::w4a8_linear`
  (w4a8_reference.py): quantizes the activations per token, then runs the GEMM;
- `qrt::w4a8_gemm_triton`: the GEMM alone, for activations already quantized (the
  fuse_act_quant pass emits it).

The weight crosses memory at 4 bits per value: each tile of int32 words is unpacked, each code
multiplied by its group scale and rounded to an int8 weight (QQQ's arithmetic), and fed to the
int8 MMA. Runs on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1 (the tests).
"""

import torch
import triton
import triton.language as tl

from .activation_reference import int8_input_fusions
from .choices import Kernel, declare
from .int8_triton import quantize_activations_int8_triton
from .w4a8_reference import CANONICAL_W4A8
from .triton_tiles import (check_launchable, flatten_rows, gemm_config, grouped_tile, load_packed_codes, output_tiles,
                           round_half_even, store_tile, unflatten_rows, wrapped_rows_cols)


@triton.jit
def w4a8_gemm_kernel(
    a_ptr, qw_ptr, gs_ptr, c_ptr, a_scale_ptr, cs_ptr, bias_ptr,
    M, N, K, group_size,
    stride_am, stride_ak, stride_qk, stride_qn, stride_gk, stride_gn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows, cols = wrapped_rows_cols(offs_m, offs_n, M, N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=in_k[None, :], other=0)  # [BLOCK_M, BLOCK_K] int8
        codes = load_packed_codes(qw_ptr, offs_k, cols, in_k, stride_qk, stride_qn, 4) - 8  # [BLOCK_K, BLOCK_N]
        group = (offs_k // group_size).to(tl.int64)
        scale = tl.load(gs_ptr + group[:, None] * stride_gk + cols[None, :] * stride_gn,
                        mask=in_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] fp32; 0 past K
        # A 4-bit code times an fp16 value is exact in fp32; one rounding, as in the reference.
        w = tl.clamp(round_half_even(codes.to(tl.float32) * scale), -128.0, 127.0).to(tl.int8)
        acc = tl.dot(a, w, acc=acc, out_dtype=tl.int32)

    a_scale = tl.load(a_scale_ptr + rows)  # [BLOCK_M] fp32, per token
    c_scale = tl.load(cs_ptr + cols)  # [BLOCK_N] fp32, per output channel
    out = acc.to(tl.float32) * a_scale[:, None] * c_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    store_tile(c_ptr, out, offs_m, offs_n, M, N, stride_cm, stride_cn)


def w4a8_tiles(m: int) -> dict:
    """gemm_config's tiles with K blocks of 64 past decode: besides the codes, each pipeline stage
    holds a group scale per (k, n), [BLOCK_K, BLOCK_N] fp32, and at BLOCK_K = 128 three or four
    stages need 320-430 KiB of shared memory, more than a Hopper SM's 227 KiB (measured on an H200)."""
    cfg = gemm_config(m)
    if m > 16:
        cfg["BLOCK_K"] = 64
    return cfg


def w4a8_gemm_triton(xq, x_scale, qweight, group_scales, channel_scales, bias, group_size: int, out_dtype):
    """xq: int8 [M, K]; x_scale: fp32 [M, 1]; canonical W4A8 weight tensors (w4a8_reference.py).
    Returns [M, N] in out_dtype."""
    check_launchable(xq, "W4A8 GEMM", "QQQ layers run as W8A8")
    m, k = xq.shape
    n = qweight.shape[1]
    if xq.dtype != torch.int8 or qweight.shape[0] != -(-k // 8):
        raise ValueError(f"W4A8 GEMM takes int8 activations [M, K] and int32 words [K / 8, N]; got {xq.dtype} "
                         f"{tuple(xq.shape)} and {tuple(qweight.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)  # [M, N]
    cfg = w4a8_tiles(m)
    grid = (output_tiles(m, n, cfg),)
    group_scales = group_scales.float()
    w4a8_gemm_kernel[grid](
        xq, qweight, group_scales, out, x_scale.reshape(-1).contiguous(), channel_scales.float().contiguous(),
        None if bias is None else bias.contiguous(),
        m, n, k, group_size,
        xq.stride(0), xq.stride(1), qweight.stride(0), qweight.stride(1), group_scales.stride(0),
        group_scales.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None,
        **cfg,
    )
    return out


@torch.library.custom_op("qrt::w4a8_linear_triton", mutates_args=())
def w4a8_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    group_scales: torch.Tensor,
    channel_scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """Triton implementation of `qrt::w4a8_linear`. x: [..., K]; returns [..., N] in x.dtype."""
    xq, x_scale, _ = quantize_activations_int8_triton(flatten_rows(x), None, None, False)  # [M, K], [M, 1]
    out = w4a8_gemm_triton(xq, x_scale, qweight, group_scales, channel_scales, bias, group_size, x.dtype)
    return unflatten_rows(out, x)


@w4a8_linear_triton.register_fake
def _(x, qweight, group_scales, channel_scales, bias, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[1])


@torch.library.custom_op("qrt::w4a8_gemm_triton", mutates_args=())
def w4a8_gemm_op(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    group_scales: torch.Tensor,
    channel_scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The W4A8 GEMM on activations already quantized per token. xq: int8 [..., K]; x_scale: fp32
    [..., 1]. Returns [..., N] in out_dtype."""
    out = w4a8_gemm_triton(flatten_rows(xq), x_scale.reshape(-1, 1), qweight, group_scales, channel_scales, bias,
                           group_size, out_dtype)
    return unflatten_rows(out, xq)


@w4a8_gemm_op.register_fake
def _(xq, x_scale, qweight, group_scales, channel_scales, bias, group_size, out_dtype):
    return xq.new_empty(*xq.shape[:-1], qweight.shape[1], dtype=out_dtype)


def _w4a8_gemm_args(args):
    """w4a8_linear_triton(x, qweight, group_scales, channel_scales, bias, group_size) -> w4a8_gemm_triton's
    weight-side args."""
    return tuple(args[1:])


declare(Kernel(
    "qrt.w4a8_linear_triton", devices=("cuda",), serves=("qrt.w4a8_linear",), replaces="qrt.w4a8_linear",
    layout=CANONICAL_W4A8, fusions=int8_input_fusions("qrt.w4a8_gemm_triton", _w4a8_gemm_args),
    why="W4A8 on a GPU: Triton int8 GEMM turning 4-bit codes into int8 weights in registers"))
