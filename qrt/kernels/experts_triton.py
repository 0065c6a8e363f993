"""Triton kernel for `qrt::fused_experts` on CUDA: `qrt::fused_experts_triton`, a grouped GEMM
over the routed (token, expert) pairs sorted by expert (the approach of vLLM's fused_moe).

Same signature and result as `qrt::fused_experts` (experts_reference.py). Two launches per block:

1. gate_up: each program takes BLOCK_M pairs routed to one expert and a BLOCK_N slice of that
   expert's gate_up weight, gathering the pairs' token rows of x: h [P, 2I] (P = T * k pairs).
2. act(gate) * up in torch, then down: the same over h's rows, each row's result scaled by its
   routing weight: y [P, D]; out = y summed over each token's k pairs.

The pairs are sorted and each expert's run padded to whole BLOCK_M blocks in torch, to a length
bounded without reading the counts, so nothing waits on the host. Weight layouts read in the tile
loop, the same ones the per-expert linears run on CUDA:
- dense [E, N, K] in the model dtype (the experts' `aten.linear`);
- packed int codes [E, ceil(K / pf), N] (int32 words along K), group scales and zero points
  [E, K / G, N] and an optional act-order permutation [E, K] (`qrt.int_linear_triton`'s layout).
"""

import torch
import triton
import triton.language as tl

from .activation_reference import act_mul
from .choices import Kernel, declare
from .layouts import NamedLayout
from .experts_reference import ExpertProjection, expert_layers
from .triton_tiles import check_launchable, load_packed_codes

DENSE, PACKED = "aten.linear", "qrt.int_linear_triton"  # the per-expert kernels whose layouts this reads


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (pairs [L] int64: the routed pairs t * k + j grouped by expert, each
    expert's run padded with P = T * k to whole blocks of block_m; block_experts [L / block_m]
    int64: each block's expert, num_experts for the unused blocks at the end).

    L = P + E * (block_m - 1) rounded up to block_m bounds every padding, without a host sync."""
    flat = topk_ids.reshape(-1)  # [P]
    count = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert
    experts = flat[order]
    rank = torch.arange(count, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts]
    length = triton.cdiv(count + num_experts * (block_m - 1), block_m) * block_m
    pairs = torch.full((length,), count, dtype=torch.int64, device=flat.device)
    pairs[(padded_end - padded)[experts] + rank] = order
    block_starts = torch.arange(0, length, block_m, device=flat.device)
    return pairs, torch.searchsorted(padded_end, block_starts, right=True)


@triton.jit
def experts_gemm_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, routing_ptr, pairs_ptr, block_experts_ptr, out_ptr,
    N, K, num_pairs, top_k, num_experts, group_size,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_se, stride_sg, stride_sn,
    stride_ze, stride_zg, stride_zn, stride_pe, stride_om, stride_on,
    ROWS_PER_TOKEN: tl.constexpr, SCALE_BY_ROUTING: tl.constexpr, PACKED_CODES: tl.constexpr,
    HAS_PERM: tl.constexpr, BITS: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    used = expert < num_experts  # the blocks past the last expert's run compute nothing
    expert = tl.minimum(expert, num_experts - 1).to(tl.int64)
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] int64
    valid = (pairs < num_pairs) & used
    if ROWS_PER_TOKEN:
        rows = tl.where(valid, pairs // top_k, 0)  # gate_up reads the token's row of x
    else:
        rows = tl.where(valid, pairs, 0)  # down reads the pair's own row of h
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    safe_cols = (cols % N).to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        if HAS_PERM:  # act-order: the expert's sorted input channel k reads the activations' perm[k]
            src_k = tl.load(perm_ptr + expert * stride_pe + offs_k, mask=in_k, other=0)
        else:
            src_k = offs_k
        x = tl.load(a_ptr + rows[:, None] * stride_am + src_k[None, :] * stride_ak,
                    mask=valid[:, None] & in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if PACKED_CODES:
            q = load_packed_codes(w_ptr + expert * stride_we, offs_k, safe_cols, in_k, stride_wk, stride_wn, BITS)
            group = (offs_k // group_size).to(tl.int64)
            scale = tl.load(s_ptr + expert * stride_se + group[:, None] * stride_sg + safe_cols[None, :] * stride_sn,
                            mask=in_k[:, None], other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + expert * stride_ze + group[:, None] * stride_zg + safe_cols[None, :] * stride_zn,
                           mask=in_k[:, None], other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - zero) * scale  # [BLOCK_K, BLOCK_N]
        else:
            w = tl.load(w_ptr + expert * stride_we + offs_k[:, None] * stride_wk + safe_cols[None, :] * stride_wn,
                        mask=in_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] of the [N, K] weight
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc=acc)
    if SCALE_BY_ROUTING:
        acc = acc * tl.load(routing_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + cols[None, :].to(tl.int64) * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & in_n[None, :])


def experts_tiles(pairs: int, num_experts: int) -> dict:
    """Tiles for `pairs` routed pairs over `num_experts` experts: a 16-row block (the smallest
    tl.dot takes) while each expert gets few rows (decode), larger ones for prefill."""
    per_expert = pairs / num_experts
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def experts_gemm(a: torch.Tensor, projection: ExpertProjection, tensors: list, pairs: torch.Tensor,
                 block_experts: torch.Tensor, cfg: dict, *, num_pairs: int, top_k: int, rows_per_token: bool,
                 routing: torch.Tensor | None = None) -> torch.Tensor:
    """[num_pairs, N] fp32: each routed pair's row of `a` (its token's row when rows_per_token)
    times its expert's weight, scaled by its routing weight when `routing` ([P] fp32) is given."""
    weight = projection.tensor(tensors, "weight")
    num_experts, k = weight.shape[0], projection.input_size
    packed = projection.kernel == PACKED
    if packed:
        scales, zeros, perm = (projection.tensor(tensors, name) for name in ("scales", "zeros", "perm"))
        n = weight.shape[2]  # [E, K / pf, N]
        w_strides, bits = (weight.stride(0), weight.stride(1), weight.stride(2)), 32 // projection.packed_factor
    else:
        scales = zeros = perm = None
        n = weight.shape[1]  # [E, N, K]: the tile loop walks K along stride 2, N along stride 1
        w_strides, bits = (weight.stride(0), weight.stride(2), weight.stride(1)), 0
    out = torch.empty(num_pairs, n, dtype=torch.float32, device=a.device)  # [P, N]
    s_strides = scales.stride() if packed else (0, 0, 0)
    z_strides = zeros.stride() if packed else (0, 0, 0)
    grid = (block_experts.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    experts_gemm_kernel[grid](
        a, weight, scales if packed else weight, zeros if packed else weight, perm if perm is not None else pairs,
        routing if routing is not None else out, pairs, block_experts, out,
        n, k, num_pairs, top_k, num_experts, projection.group_size or 1,
        a.stride(0), a.stride(1), *w_strides, *s_strides, *z_strides, perm.stride(0) if perm is not None else 0,
        out.stride(0), out.stride(1),
        ROWS_PER_TOKEN=rows_per_token, SCALE_BY_ROUTING=routing is not None, PACKED_CODES=packed,
        HAS_PERM=perm is not None, BITS=bits or 4,
        # fp32 activations get an exact fp32 dot; Triton's interpreter multiplies bf16 operands
        # wrongly (Triton 3.7), so there the dot is done in fp32 as well.
        FP32_DOT=a.dtype == torch.float32 or triton.knobs.runtime.interpret, **cfg,
    )
    return out


@torch.library.custom_op("qrt::fused_experts_triton", mutates_args=())
def fused_experts_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         gate_up: list[torch.Tensor], down: list[torch.Tensor], experts: str,
                         activation: str) -> torch.Tensor:
    """Triton implementation of `qrt::fused_experts`. x: [T, D]; returns [T, D] in x's dtype."""
    check_launchable(x, "fused-experts kernel", "use qrt::fused_experts")
    layers = expert_layers(experts)
    tokens, top_k = topk_ids.shape
    num_pairs, num_experts = tokens * top_k, gate_up[0].shape[0]
    cfg = experts_tiles(num_pairs, num_experts)
    pairs, block_experts = align_pairs_by_expert(topk_ids, num_experts, cfg["BLOCK_M"])
    shared = dict(num_pairs=num_pairs, top_k=top_k)
    hidden = experts_gemm(x, layers.gate_up, gate_up, pairs, block_experts, cfg, rows_per_token=True, **shared)
    hidden = act_mul(hidden.to(x.dtype), activation)  # [P, I], rounded as the per-expert linears round it
    y = experts_gemm(hidden, layers.down, down, pairs, block_experts, cfg, rows_per_token=False,
                     routing=topk_weights.reshape(-1).float().contiguous(), **shared)  # [P, D]
    return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


@fused_experts_triton.register_fake
def _(x, topk_ids, topk_weights, gate_up, down, experts, activation):
    return torch.empty_like(x)


def _reads(gate_up: str, down: str) -> bool:
    return gate_up == down and gate_up in (DENSE, PACKED)


declare(Kernel(
    "qrt.fused_experts_triton", devices=("cuda",), serves=("qrt.fused_experts",), layout=NamedLayout("dense or packed"),
    accepts=lambda gate_up, down, bias=False: not bias and _reads(gate_up, down),  # it adds no biases
    why="experts on a GPU: one grouped Triton GEMM per projection over the routed pairs sorted by expert, the "
        "weight tile dequantized in registers"))
