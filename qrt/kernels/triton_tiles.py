"""What the Triton kernel files share: the GEMMs' tile order, tile sizes and edge handling, the
rounding helpers that make the interpreter compute what the GPU does, the chunk size of the
per-row quantizers, and the host-side checks and reshapes around a launch.

Shapes, as everywhere in the Triton files: a linear's activations are flattened to [M, K] rows,
its weight is [N, K] (or packed along K), its output is [M, N]; a GEMM launches one program per
BLOCK_M x BLOCK_N output tile, and a per-row quantizer one program per row.
"""

import torch
import triton
import triton.language as tl

from .fp8_reference import FP8_DTYPE

# A per-row program streams its row in chunks of at most this many elements: 4 warps × 32 lanes
# × 8 bf16 = 1024, one 16-byte load per lane, and a register footprint independent of K.
ROW_BLOCK = 1024


def row_block(k: int) -> int:
    """Elements a per-row program loads per step for rows of k: ROW_BLOCK, or k rounded up to a
    power of two (tl.arange needs one) when the row is shorter."""
    return min(triton.next_power_of_2(k), ROW_BLOCK)


def check_launchable(t: torch.Tensor, kernels: str, on_the_cpu: str | None = None) -> None:
    """Refuse CPU tensors outside the interpreter with a message saying what to use instead:
    compiled Triton kernels launch on CUDA only, and a CPU pointer would crash the launch.

    kernels names the kernels in the message ("fp8 kernels"); on_the_cpu is the alternative there
    ("use qrt::fp8_linear"), if there is one."""
    if t.device.type != "cuda" and not triton.knobs.runtime.interpret:
        alternative = f"; on the CPU {on_the_cpu}" if on_the_cpu else ""
        raise RuntimeError(f"Triton {kernels}: CUDA tensors only, got a tensor on {t.device}. CPU tensors run only "
                           f"under TRITON_INTERPRET=1 (tests){alternative}.")


def check_fp8_operands(xq: torch.Tensor, weight: torch.Tensor) -> None:
    """xq: [M, K] and weight: [N, K], both float8_e4m3fn, as the fp8 GEMMs read them."""
    if xq.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 GEMM takes {FP8_DTYPE} operands, got {xq.dtype} and {weight.dtype}")
    if weight.shape[1] != xq.shape[1]:
        raise ValueError(f"fp8 GEMM: activations have K={xq.shape[1]} but the weight is {tuple(weight.shape)}")


def flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., K] as the [M, K] rows the kernels take (a view where x's strides allow)."""
    return x.reshape(-1, x.shape[-1])


def unflatten_rows(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A kernel's [M, N] result with the leading dims of its input `like` ([..., K]): [..., N]."""
    return out.reshape(*like.shape[:-1], out.shape[-1])


def gemm_config(m: int) -> dict:
    """Tile sizes and launch parameters for an [m, K] x [K, N] fp8 or int8 GEMM, chosen by m alone.
    BLOCK_K >= 32, the int8 MMA's k."""
    if m <= 16:
        # Decode: one 16-row tile (the smallest tl.dot takes) and the kernel streams the weight.
        # Narrow N tiles give enough programs to occupy every SM (4096 / 32 = 128 on 132 SMs),
        # long K tiles and deep pipelining keep many weight loads in flight.
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 256:
        # Small batches: 64 rows is one Hopper warpgroup MMA; still enough tiles to fill the SMs.
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    # Prefill: compute-bound, the largest tiles that fit 3 stages of fp8 or int8 operands in shared
    # memory (96 KiB); they take half the space of bf16 ones at the same K depth.
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)


def output_tiles(m: int, n: int, cfg: dict) -> int:
    """Programs along the first grid axis of a GEMM: one per BLOCK_M x BLOCK_N tile of the [m, n]
    output, in the order grouped_tile decodes."""
    return triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])


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
def wrapped_rows_cols(offs_m, offs_n, M, N):
    """The rows ([BLOCK_M]) and columns ([BLOCK_N]) a tile loads from, as int64.

    Those past the edge wrap onto valid ones instead of being masked, so loads along M and N stay
    in bounds and unmasked; store_tile drops their results. int64: M * K and M * N can pass 2**31
    (long prefill, large vocab)."""
    return (offs_m % M).to(tl.int64), (offs_n % N).to(tl.int64)


@triton.jit
def store_tile(c_ptr, out, offs_m, offs_n, M, N, stride_cm, stride_cn):
    """Store the [BLOCK_M, BLOCK_N] tile `out` at rows offs_m and columns offs_n of the [M, N]
    output c_ptr, in the output's dtype, dropping what lies past the edge."""
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def load_packed_codes(qw_ptr, offs_k, cols, in_k, stride_qk, stride_qn, BITS: tl.constexpr):
    """The unsigned BITS-bit codes ([BLOCK_K, BLOCK_N] int32) at rows offs_k and columns cols of a
    weight packed along K into int32 words [ceil(K * BITS / 32), N], the lowest bits holding the
    first k of each word. Rows past K (in_k false) give 0."""
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # Each word feeds PF consecutive k; the repeated addresses are served from L1.
    words = tl.load(qw_ptr + (offs_k // PF).to(tl.int64)[:, None] * stride_qk + cols[None, :] * stride_qn,
                    mask=in_k[:, None], other=0)  # [BLOCK_K, BLOCK_N] int32
    # Arithmetic shift of a negative word fills with ones; the mask drops them.
    return (words >> ((offs_k % PF) * BITS)[:, None]) & MASK


@triton.jit
def round_half_even(v):
    """fp32 v with |v| < 2**22, rounded to an integer, ties to even (torch.round), still fp32.

    Adding 1.5 * 2**23 moves v where fp32's step is 1, so the IEEE add itself rounds to nearest
    even; subtracting it back is exact. No libdevice call, so the interpreter runs the same code."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def round_to_e4m3_grid(v):
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
