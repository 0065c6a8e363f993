"""Triton kernels that compute an activation and quantize it to int8 per token in one pass over the
row: `qrt::rms_norm_quant_int8_triton` (`qrt::rms_norm`, either rounding) and
`qrt::silu_mul_quant_int8_triton` (`qrt::act_mul` with silu). The fuse_act_quant pass puts them before int8_gemm_triton / w4a8_gemm_triton
on CUDA: the activation then leaves the kernel as int8 plus one scale per token, instead of being
written in the model dtype and read back by a separate quantization kernel.

Numerics are the unfused graph's (int8_fused_reference.py): every rounding the model's code makes
to its dtype (bf16 or fp16) is made here too. bf16 rounding is done on the bits, ties to even,
because Triton's interpreter truncates bf16 casts; on the GPU it is the same rounding as a cast.
"""

import torch
import triton
import triton.language as tl

from .int8_reference import MIN_SCALE
from .triton_tiles import check_launchable, round_half_even, row_block

# How a value produced in fp32 is rounded to the model dtype.
_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _to_model_dtype(v, ROUNDING: tl.constexpr):
    """fp32 v rounded to the model dtype and returned as fp32 (exact after the rounding)."""
    if ROUNDING == 1:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    elif ROUNDING == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _normed(x, w, inv_rms, ROUNDING: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """qrt::rms_norm's value for one block of a row, with its roundings (activation_reference.py)."""
    if UNIT_OFFSET:
        return _to_model_dtype((x * inv_rms) * (1.0 + w), ROUNDING)
    return _to_model_dtype(w * _to_model_dtype(x * inv_rms, ROUNDING), ROUNDING)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, w_ptr, q_ptr, scale_ptr,
    D, eps,
    stride_xm, stride_qm,
    ROUNDING: tl.constexpr, UNIT_OFFSET: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        squares += x * x
    # rsqrt as 1 / sqrt, both correctly rounded: what torch.rsqrt computes on the CPU.
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(squares, axis=0), D.to(tl.float32)) + eps))

    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = _normed(x, w, inv_rms, ROUNDING, UNIT_OFFSET)
        amax = tl.maximum(amax, tl.abs(h))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 127.0), MIN_SCALE)
    tl.store(scale_ptr + row, scale)

    # Third pass recomputes h (cheap) rather than holding the row in registers.
    q_row = q_ptr + row * stride_qm
    for k0 in range(0, D, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = _normed(x, w, inv_rms, ROUNDING, UNIT_OFFSET)
        q = tl.clamp(round_half_even(tl.div_rn(h, scale)), -128.0, 127.0)
        tl.store(q_row + offs, q.to(tl.int8), mask=mask)


@triton.jit
def _silu_mul(y_row, offs, mask, I, ROUNDING: tl.constexpr):
    gate = tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_row + I + offs, mask=mask, other=0.0).to(tl.float32)
    # silu as x / (1 + exp(-x)), ATen's formula, rounded to the model dtype; then the product.
    silu = _to_model_dtype(tl.div_rn(gate, 1.0 + tl.exp(-gate)), ROUNDING)
    return _to_model_dtype(silu * up, ROUNDING)


@triton.jit
def _silu_mul_quant_kernel(
    y_ptr, q_ptr, scale_ptr,
    I,
    stride_ym, stride_qm,
    ROUNDING: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_ym
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_mul(y_row, offs, offs < I, I, ROUNDING)))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 127.0), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    q_row = q_ptr + row * stride_qm
    for k0 in range(0, I, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < I
        h = _silu_mul(y_row, offs, mask, I, ROUNDING)
        q = tl.clamp(round_half_even(tl.div_rn(h, scale)), -128.0, 127.0)
        tl.store(q_row + offs, q.to(tl.int8), mask=mask)


def _check(t: torch.Tensor) -> None:
    check_launchable(t, "fused int8 quantization kernels")
    if t.dtype not in _ROUNDING:
        raise ValueError(f"fused int8 quantization takes fp32/bf16/fp16 activations, got {t.dtype}")


@torch.library.custom_op("qrt::rms_norm_quant_int8_triton", mutates_args=())
def rms_norm_quant_int8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                               unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qrt::rms_norm then per-token int8 quantization. x: [..., D]; weight: [D].
    Returns (q int8 [..., D], scale fp32 [..., 1])."""
    _check(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()  # [M, D]
    m = x2.shape[0]
    q = torch.empty((m, d), dtype=torch.int8, device=x.device)  # [M, D]
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)  # [M, 1]
    _rms_norm_quant_kernel[(m,)](
        x2, weight.contiguous(), q, scale, d, eps, x2.stride(0), q.stride(0),
        ROUNDING=_ROUNDING[weight.dtype], UNIT_OFFSET=unit_offset, MIN_SCALE=MIN_SCALE, BLOCK=row_block(d), num_warps=4,
    )
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


@rms_norm_quant_int8_triton.register_fake
def _(x, weight, eps, unit_offset):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@torch.library.custom_op("qrt::silu_mul_quant_int8_triton", mutates_args=())
def silu_mul_quant_int8_triton(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up for y = [gate | up], then per-token int8 quantization. y: [..., 2I].
    Returns (q int8 [..., I], scale fp32 [..., 1])."""
    _check(y)
    inter = y.shape[-1] // 2
    y2 = y.reshape(-1, 2 * inter).contiguous()  # [M, 2I]
    m = y2.shape[0]
    q = torch.empty((m, inter), dtype=torch.int8, device=y.device)  # [M, I]
    scale = torch.empty((m, 1), dtype=torch.float32, device=y.device)  # [M, 1]
    _silu_mul_quant_kernel[(m,)](
        y2, q, scale, inter, y2.stride(0), q.stride(0),
        ROUNDING=_ROUNDING[y.dtype], MIN_SCALE=MIN_SCALE, BLOCK=row_block(inter),
        num_warps=4,
    )
    return q.reshape(*y.shape[:-1], inter), scale.reshape(*y.shape[:-1], 1)


@silu_mul_quant_int8_triton.register_fake
def _(y):
    inter = y.shape[-1] // 2
    return (y.new_empty(*y.shape[:-1], inter, dtype=torch.int8),
            y.new_empty(*y.shape[:-1], 1, dtype=torch.float32))
