"""Triton kernels for the fp8 (e4m3) linear op: per-token activation quantization and a scaled
fp8 GEMM, fused behind `qrt::fp8_linear_triton`.

`qrt::fp8_linear_triton` has the signature and semantics of `qrt::fp8_linear` (fp8_reference.py),
so the swap pass can replace one node with the other. It runs on CUDA tensors, and on CPU tensors
only under TRITON_INTERPRET=1, which is how the tests exercise it.
"""

import torch
import triton
import triton.language as tl

from qrt.kernels.fp8_reference import FP8_DTYPE, FP8_MAX, MIN_SCALE

from .choices import Kernel, declare

# One program streams a row in chunks of at most this many elements: 4 warps × 32 lanes × 8
# bf16 = 1024, one 16-byte load per lane, and a register footprint independent of K.
_QUANT_BLOCK_K = 1024


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 v (|v| <= 448) to the nearest e4m3 value, ties to even, staying in fp32.

    The cast to fp8 that follows is then exact. On the GPU this changes nothing (the hardware cast
    also rounds to nearest even), but Triton's interpreter, where every kernel is tested, rounds
    fp8 casts wrongly (ties away from zero, a mantissa carry can halve the value, subnormals off).
    """
    # Rounding works on the magnitude; the sign bit is put back at the end, because negating
    # (which Triton does as 0 - x) would turn the reference's -0 codes into +0.
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag_bits = bits ^ sign
    mag = mag_bits.to(tl.float32, bitcast=True)
    # e4m3 normals keep 3 of fp32's 23 mantissa bits: add just under half a step, plus the lowest
    # kept bit so that ties go to even, then clear the 20 dropped bits. A carry into the exponent
    # is the correct result, and |v| <= 448 keeps it finite.
    normal = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20 << 20
    # Below 2**-6 e4m3 is subnormal with a fixed step of 2**-9; adding 2**14 moves the value to
    # where fp32's own step is 2**-9, so the fp32 add does the round-to-nearest-even.
    subnormal = ((mag + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    rounded = tl.where(mag < 0.015625, subnormal, normal)
    return (rounded | sign).to(tl.float32, bitcast=True)


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
        tl.store(q_row + offs, _round_to_e4m3_grid(q).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column offsets ([BLOCK_M], [BLOCK_N]) of this program's output tile.

    Grouped launch order: GROUP_M row tiles sweep the column tiles together, so each weight tile
    is fetched from HBM once per group rather than once per row tile (L2 reuse for prefill)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap onto valid ones instead of being masked, so loads along
    # M and N stay in bounds and unmasked; the masked store drops them. int64: M * K and M * N
    # can pass 2**31 (long prefill, large vocab).
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
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
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=c_mask)


def _gemm_config(m: int) -> dict:
    """Tile sizes and launch parameters for an [m, K] x [K, N] fp8 GEMM, chosen by m alone."""
    if m <= 16:
        # Decode: one 16-row tile (the smallest tl.dot takes) and the kernel streams the weight.
        # Narrow N tiles give enough programs to occupy every SM (4096 / 32 = 128 on 132 SMs),
        # long K tiles and deep pipelining keep many weight loads in flight.
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 256:
        # Small batches: 64 rows is one Hopper warpgroup MMA; still enough tiles to fill the SMs.
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    # Prefill: compute-bound, the largest tiles that fit 3 stages in shared memory (96 KiB).
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)


def _check_launchable(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise RuntimeError(
            f"the Triton fp8 kernels need CUDA tensors, got a tensor on {t.device}. CPU tensors run "
            "only under TRITON_INTERPRET=1 (tests); on CPU use qrt::fp8_linear instead."
        )


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization, same results as `quantize_rows_fp8`.

    x: [M, K] bf16/fp16/fp32, any strides. Returns (q [M, K] float8_e4m3fn, scale [M, 1] fp32).
    """
    _check_launchable(x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)  # [M, K] fp8
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)  # [M, 1] fp32
    _quantize_rows_fp8_kernel[(m,)](
        x, q, scale,
        k,
        x.stride(0), x.stride(1), q.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK_K=min(triton.next_power_of_2(k), _QUANT_BLOCK_K),
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
    _check_launchable(xq)
    m, k = xq.shape
    n = weight.shape[0]
    if xq.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 GEMM takes {FP8_DTYPE} operands, got {xq.dtype} and {weight.dtype}")
    if weight.shape[1] != k:
        raise ValueError(f"fp8 GEMM: activations have K={k} but the weight is {tuple(weight.shape)}")
    x_scale = x_scale.reshape(-1).contiguous()  # [M] fp32
    weight_scale = weight_scale.reshape(-1).contiguous()  # [N] fp32
    if bias is not None:
        bias = bias.contiguous()  # [N]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)  # [M, N]
    cfg = _gemm_config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_gemm_kernel[grid](
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
    k = x.shape[-1]
    xq, x_scale = quantize_rows_fp8_triton(x.reshape(-1, k))  # [M, K] fp8, [M, 1] fp32
    out = fp8_gemm_triton(xq, weight, x_scale, weight_scale, bias, x.dtype)  # [M, N]
    return out.reshape(*x.shape[:-1], weight.shape[0])


@fp8_linear_triton.register_fake
def _(x, weight, weight_scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])

declare(Kernel(
    "qrt.fp8_linear_triton", devices=("cuda",), serves=("qrt.fp8_linear",), replaces="qrt.fp8_linear",
    layout="fp8", why="fp8 weights on a GPU: Triton fp8 GEMM, fused per-token x per-channel scaling"))
