"""A Triton kernel for `qrt::decode_attention` (decode_attention_reference.py) on CUDA.

One program per (batch row, query head) reads the row's cache slot and extent from the device
and walks the row's live entries in blocks of BLOCK_S, with the running maximum and sum of an
online softmax. Nothing is read back to the host, so a decode step holds no synchronisation and
can be captured in a CUDA graph; the reference op reads every row's extent to the host and loops
in Python.

With attention sinks (gpt-oss), each head's online softmax starts from its sink logit: a weight of
one at that maximum, and no V row.

Numerics: fp32 throughout, as the reference (an e4m3 cache entry is widened, times its scale,
rounded to the model dtype, as the reference reads it); they differ in summation order and the
online softmax's rescaling, then agree on the rounding to the model dtype. A row's result
depends on its own extent only, never on its batch.
"""

import torch
import triton
import triton.language as tl

from .choices import Kernel, declare
from .decode_attention_reference import KV_CACHE
from .triton_tiles import check_launchable

BLOCK_S = 64  # cache entries per step of the walk


@triton.jit
def decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, first_ptr, last_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_ks, stride_vn, stride_vh, stride_vs, stride_ob, stride_oh,
    scale, softcap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    FP8_CACHE: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    slot = tl.load(slots_ptr + row).to(tl.int64)
    lo = tl.load(first_ptr + row)
    hi = tl.load(last_ptr + row)
    d = tl.arange(0, BLOCK_D)
    in_d = d < HEAD_DIM
    model_dtype = out_ptr.dtype.element_ty
    q = tl.load(q_ptr + row * stride_qb + head * stride_qh + d, mask=in_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    k_row = k_ptr + slot * stride_kn + kv_head * stride_kh
    v_row = v_ptr + slot * stride_vn + kv_head * stride_vh
    if FP8_CACHE:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    if SINKS:
        # The head's sink logit starts the online softmax: it counts in the max and the sum, and
        # weighs no V row.
        running_max = tl.load(sinks_ptr + head).to(tl.float32)
        running_sum = tl.full((), 1.0, tl.float32)
    else:
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(lo, hi + 1, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        live = s <= hi
        mask = live[:, None] & in_d[None, :]
        k = tl.load(k_row + s[:, None] * stride_ks + d[None, :], mask=mask, other=0.0)  # [BLOCK_S, BLOCK_D]
        v = tl.load(v_row + s[:, None] * stride_vs + d[None, :], mask=mask, other=0.0)
        if FP8_CACHE:
            k = (k.to(tl.float32) * k_scale).to(model_dtype)
            v = (v.to(tl.float32) * v_scale).to(model_dtype)
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale  # [BLOCK_S]
        if SOFTCAP:
            # softcap * tanh(scores / softcap), tanh written with exp: 1 - 2 / (exp(2x) + 1)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(live, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)  # [BLOCK_S]; 0 past the extent
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v.to(tl.float32), axis=0)
        running_max = new_max
    out = acc / running_sum
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(model_dtype), mask=in_d)


@torch.library.custom_op("qrt::decode_attention_triton", mutates_args=())
def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            first: torch.Tensor, last: torch.Tensor, scale: float, softcap: float,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract (decode_attention_reference.decode_attention): q [B, H, hd];
    caches [N, KVH, S, hd] with unit stride along hd; slots, first, last [B]; sinks [H] or None.
    Returns [B, H, hd]."""
    check_launchable(q, "decode attention", "use qrt::decode_attention")
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode attention reads cache rows of unit stride along head_dim")
    q = q.contiguous()
    out = torch.empty_like(q)  # [B, H, hd]
    fp8 = k_scale is not None
    decode_attention_kernel[(rows, heads)](
        q, k_cache, v_cache, slots, first, last, k_scale if fp8 else q, v_scale if fp8 else q,
        q if sinks is None else sinks.contiguous(), out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        scale, softcap if softcap > 0 else 1.0,
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=BLOCK_S,
        FP8_CACHE=fp8, SOFTCAP=softcap > 0, SINKS=sinks is not None,
    )
    return out


@decode_attention_triton.register_fake
def _(q, k_cache, v_cache, slots, first, last, scale, softcap, k_scale, v_scale, sinks=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


declare(Kernel(
    "qrt.decode_attention_triton", devices=("cuda",), serves=("qrt.decode_attention",),
    replaces="qrt.decode_attention", layout=KV_CACHE, recorded_as="attention_kernel", preference=-10,
    why="CUDA: Triton, one program per (row, query head), each row's extent read on the device "
        "(no host synchronisation; capturable in a CUDA graph)"))
