"""Triton GEMM for 4-bit table-lookup weights (NF4, FP4, NVFP4, MXFP4), behind
`qrt::lut4_linear_triton`.

Same signature and semantics as `qrt::lut4_linear` (lut4_reference.py), on its layout: codes two a
byte along K ([N, K / 2], the low nibble first), block scales as stored ([N, K / G]: fp32, or the
bits of e4m3 / e8m0 values), a 16-entry fp32 table and an optional global scale. The weight tile is
unpacked, looked up and scaled in registers, so the weight crosses memory at its 4.25-4.5 bits.
Tiles and split-K are those of the integer GEMM (int_triton.py), whose decode and prefill shapes
these weights share.
"""

import torch
import triton
import triton.language as tl

from .choices import Kernel, declare
from .int_triton import gemm_tiles
from .lut4_reference import LUT4_CODES, SCALE_FORMATS
from .triton_tiles import (check_launchable, flatten_rows, grouped_tile, output_tiles, store_tile, unflatten_rows,
                           wrapped_rows_cols)

# constexpr globals: a jitted function may read no other kind (the interpreter does not check it).
E4M3, E8M0 = tl.constexpr(SCALE_FORMATS["e4m3"]), tl.constexpr(SCALE_FORMATS["e8m0"])


@triton.jit
def decode_scale(stored, SCALE_FORMAT: tl.constexpr):
    """Stored block scales -> fp32, exactly, by building fp32 bits (no exp2: it is approximate on
    the GPU)."""
    if SCALE_FORMAT == E4M3:
        bits = stored.to(tl.int32)
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        return tl.where((bits & 0x80) != 0, -value, value)
    elif SCALE_FORMAT == E8M0:
        exponent = stored.to(tl.int32)
        return tl.where(exponent == 0, 0x00400000, exponent << 23).to(tl.float32, bitcast=True)  # 2^-127 subnormal
    else:
        return stored.to(tl.float32)


@triton.jit
def lut4_gemm_kernel(
    x_ptr, codes_ptr, s_ptr, table_ptr, global_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_cn, stride_ck, stride_sn, stride_sg,
    stride_os, stride_om, stride_on,
    SCALE_FORMAT: tl.constexpr, HAS_GLOBAL: tl.constexpr, GLOBAL_DIVIDES: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows, cols = wrapped_rows_cols(offs_m, offs_n, M, N)
    if HAS_GLOBAL:
        g = tl.load(global_ptr).to(tl.float32)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        # Each byte feeds two consecutive k; the repeated addresses are served from L1.
        byte = tl.load(codes_ptr + cols[None, :] * stride_cn + (offs_k // 2).to(tl.int64)[:, None] * stride_ck,
                       mask=in_k[:, None], other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N]
        code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
        value = tl.load(table_ptr + code)  # [BLOCK_K, BLOCK_N] fp32
        group = (offs_k // group_size).to(tl.int64)
        stored = tl.load(s_ptr + cols[None, :] * stride_sn + group[:, None] * stride_sg, mask=in_k[:, None], other=0)
        scale = decode_scale(stored, SCALE_FORMAT)
        if HAS_GLOBAL:
            if GLOBAL_DIVIDES:
                scale = tl.div_rn(scale, g)
            else:
                scale = scale * g
        w = value * scale  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc=acc)

    store_tile(out_ptr + split * stride_os, acc, offs_m, offs_n, M, N, stride_om, stride_on)  # this split's sums


@torch.library.custom_op("qrt::lut4_linear_triton", mutates_args=())
def lut4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, table: torch.Tensor,
                       global_scale: torch.Tensor | None, bias: torch.Tensor | None, group_size: int, scale_format: int,
                       global_divides: bool) -> torch.Tensor:
    """Triton implementation of `qrt::lut4_linear`. x: [..., K]; returns [..., N] in x.dtype."""
    check_launchable(x, "4-bit table GEMM", "use qrt::lut4_linear")
    x2 = flatten_rows(x)  # [M, K]
    m, k = x2.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"4-bit table GEMM: activations have K={k}, but codes {tuple(packed.shape)} hold "
                         f"{packed.shape[1] * 2} columns")
    cfg = gemm_tiles(m, n, k, fp32=x2.dtype == torch.float32)
    split_k = cfg["SPLIT_K"]
    # fp32 partial sums: the bias is added to them and the result rounded to x's dtype once.
    out = torch.empty((split_k, m, n), dtype=torch.float32, device=x2.device)  # [SPLIT_K, M, N]
    stored = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    lut4_gemm_kernel[(output_tiles(m, n, cfg), split_k)](
        x2, packed, stored, table, global_scale if global_scale is not None else table, out,
        m, n, k, group_size,
        x2.stride(0), x2.stride(1), packed.stride(0), packed.stride(1), stored.stride(0), stored.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        SCALE_FORMAT=scale_format, HAS_GLOBAL=global_scale is not None, GLOBAL_DIVIDES=global_divides,
        # As in the integer GEMM: fp32 activations get an exact fp32 dot, and the interpreter too.
        FP32_DOT=x2.dtype == torch.float32 or triton.knobs.runtime.interpret,
        **cfg,
    )
    y = out[0] if split_k == 1 else out.sum(dim=0)
    if bias is not None:
        y = y + bias.float()
    return unflatten_rows(y.to(x.dtype), x)


@lut4_linear_triton.register_fake
def _(x, packed, scales, table, global_scale, bias, group_size, scale_format, global_divides):
    return x.new_empty(*x.shape[:-1], packed.shape[0])


declare(Kernel(
    "qrt.lut4_linear_triton", devices=("cuda",), serves=("qrt.lut4_linear",), replaces="qrt.lut4_linear",
    layout=LUT4_CODES, why="4-bit table codes on a GPU: Triton GEMM looking codes up and scaling them in registers"))
