"""Triton kernels for static-activation fp8 (AutoFP8 / ModelOpt FP8): quantization with the
checkpoint's input scale, then fp8_triton's scaled fp8 GEMM, fused behind
`qrt::fp8_static_linear_triton`.

`qrt::fp8_static_linear_triton` has the signature and semantics of `qrt::fp8_static_linear`
(fp8_static_reference.py), so the swap pass can replace one node with the other. Like
fp8_triton.py it runs on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1, which is
how the tests run it.
"""

import torch
import triton
import triton.language as tl

from qrt.kernels.fp8_reference import FP8_DTYPE, FP8_MAX
from qrt.kernels.fp8_triton import fp8_gemm_triton
from qrt.kernels.triton_tiles import check_launchable, flatten_rows, round_to_e4m3_grid, row_block, unflatten_rows

from .choices import Kernel, declare
from .fp8_reference import FP8_CODES


@triton.jit
def _quantize_static_fp8_kernel(
    x_ptr, q_ptr, scale_ptr,
    K,
    stride_xm, stride_xk, stride_qm,
    FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    # The scale is read on the device: no host sync, and the launch stays CUDA-graph capturable.
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptr + row * stride_xm + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
    # div_rn: Triton's `/` on fp32 is approximate on the GPU; codes must match the reference's
    # IEEE division bit for bit.
    q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_qm + offs, round_to_e4m3_grid(q).to(q_ptr.dtype.element_ty), mask=mask)


def quantize_static_fp8_triton(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """fp8 quantization with a given scale, same results as `quantize_static_fp8`.

    x: [M, K] bf16/fp16/fp32, any strides; input_scale: [1] fp32. Returns [M, K] float8_e4m3fn.
    """
    check_launchable(x, "fp8 kernels", "use qrt::fp8_static_linear")
    m, k = x.shape
    if input_scale.numel() != 1:
        raise ValueError(f"static fp8: input_scale must hold one value, got shape {tuple(input_scale.shape)}")
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)  # [M, K] fp8
    block_k = row_block(k)  # elements per program: the row is split along K over programs
    _quantize_static_fp8_kernel[(m, triton.cdiv(k, block_k))](
        x, q, input_scale.float(),
        k,
        x.stride(0), x.stride(1), q.stride(0),
        FP8_MAX=FP8_MAX, BLOCK_K=block_k,
        num_warps=4,
    )
    return q


@torch.library.custom_op("qrt::fp8_static_linear_triton", mutates_args=())
def fp8_static_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Triton implementation of `qrt::fp8_static_linear`.

    x: [..., K] bf16/fp16/fp32; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32;
    input_scale: [1] fp32; bias: [N] or None. Returns [..., N] in x.dtype.
    """
    x2d = flatten_rows(x)  # [M, K]
    xq = quantize_static_fp8_triton(x2d, input_scale)  # [M, K] fp8
    # The GEMM takes a per-token scale; a static scale is the same for every token.
    x_scale = input_scale.float().reshape(1, 1).expand(x2d.shape[0], 1)  # [M, 1] fp32
    out = fp8_gemm_triton(xq, weight, x_scale, weight_scale, bias, x.dtype)  # [M, N]
    return unflatten_rows(out, x)


@fp8_static_linear_triton.register_fake
def _(x, weight, weight_scale, input_scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])

declare(Kernel(
    "qrt.fp8_static_linear_triton", devices=("cuda",), serves=("qrt.fp8_static_linear",),
    replaces="qrt.fp8_static_linear", layout=FP8_CODES,
    why="fp8 weights on a GPU: static input scale, Triton fp8 GEMM"))
