"""qrt::fused_experts_triton (under Triton's interpreter) against qrt::fused_experts with plain-torch
experts, on random routings: dense weights and packed int4/int8 ones with group scales, zero
points and per-expert act-order permutations; and the alignment of routed pairs into blocks."""

import pytest
import torch
import torch.nn.functional as F

from helpers.kernel_checks import BF16_RTOL, DEVICE, SUM_RTOL, assert_within
from qrt.kernels.experts_reference import ExpertLayers, ExpertProjection, register_expert_layers
from qrt.kernels.experts_triton import align_pairs_by_expert
from qrt.kernels.int_reference import pack_rows

D, I = 64, 48  # hidden size, one expert's intermediate size


def _dense(gen, experts, n, k, dtype):
    weight = (torch.randn(experts, n, k, generator=gen) * 0.1).to(dtype)  # [E, N, K]

    def apply(e, tensors, x):
        return F.linear(x, tensors[0][e])
    return [weight], ExpertProjection(apply, apply, ("weight",), "aten.linear", k)


def _packed(gen, experts, n, k, dtype, bits, group, act_order):
    q = torch.randint(0, 2**bits, (experts, k, n), generator=gen, dtype=torch.int32)  # [E, K, N]
    weight = torch.stack([pack_rows(q[e], bits) for e in range(experts)])  # [E, K / pf, N] int32
    scales = (torch.rand(experts, k // group, n, generator=gen) * 0.02 + 0.005).to(dtype)  # [E, K / G, N]
    zeros = torch.rand(experts, k // group, n, generator=gen) * (2**bits - 1)  # fractional zero points
    tensors, names = [weight, scales, zeros.to(dtype)], ("weight", "scales", "zeros")
    if act_order:
        tensors.append(torch.stack([torch.randperm(k, generator=gen) for _ in range(experts)]))  # [E, K]
        names += ("perm",)

    def apply(e, ts, x):
        perm = ts[3][e] if act_order else None
        return torch.ops.qrt.int_linear(x, ts[0][e], ts[1][e], ts[2][e], perm, None, bits, group)
    return tensors, ExpertProjection(apply, apply, names, "qrt.int_linear_triton", k, 32 // bits, group)


def _routing(gen, tokens, experts, top_k, skew):
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:  # most tokens pick the same experts; some experts get none
        logits[:, :top_k] += 4.0
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return ids, weights


CASES = {
    "dense fp32": dict(kind="dense", dtype=torch.float32),
    "dense bf16": dict(kind="dense", dtype=torch.bfloat16),
    "int4 g16": dict(kind="packed", dtype=torch.float32, bits=4, group=16, act_order=False),
    "int4 g16 act-order bf16": dict(kind="packed", dtype=torch.bfloat16, bits=4, group=16, act_order=True),
    "int8 g16 act-order": dict(kind="packed", dtype=torch.float32, bits=8, group=16, act_order=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens,experts,top_k,skew", [(1, 4, 2, False), (7, 8, 3, True), (40, 6, 2, False)])
def test_triton_experts_match_the_per_expert_loop(case, tokens, experts, top_k, skew):
    spec = dict(CASES[case])
    kind, dtype = spec.pop("kind"), spec.pop("dtype")
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    make = _dense if kind == "dense" else _packed
    gate_up, gate_up_proj = make(gen, experts, 2 * I, D, dtype, **spec)
    down, down_proj = make(gen, experts, D, I, dtype, **spec)
    name = f"test-{case}-{experts}"
    register_expert_layers(name, ExpertLayers(gate_up_proj, down_proj))
    x = torch.randn(tokens, D, generator=gen).to(dtype)
    ids, weights = _routing(gen, tokens, experts, top_k, skew)
    args = ([t.to(DEVICE) for t in gate_up], [t.to(DEVICE) for t in down], name, "silu")
    expected = torch.ops.qrt.fused_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), *args)
    got = torch.ops.qrt.fused_experts_triton(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), *args)
    assert got.dtype == dtype and got.shape == (tokens, D)
    # Both sum the same products in fp32 in another order; bf16 outputs (and the bf16 hidden
    # state between the two projections) add a rounding step each. An output that cancels down
    # far below its row's values still carries the roundings of its terms, hence the row's largest.
    scale = expected.float().abs() + expected.float().abs().amax(dim=-1, keepdim=True)
    tol = scale * (SUM_RTOL if dtype == torch.float32 else 4 * BF16_RTOL)
    assert_within(got.cpu(), expected.cpu(), tol.cpu())


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_pairs_align_into_blocks_of_one_expert(block_m):
    gen = torch.Generator().manual_seed(block_m)
    experts, top_k = 6, 2
    ids, _ = _routing(gen, 13, experts, top_k, skew=True)
    pairs, block_experts = align_pairs_by_expert(ids, experts, block_m)
    count = ids.numel()
    real = pairs[pairs < count]
    assert sorted(real.tolist()) == list(range(count))  # every routed pair once
    blocks = pairs.view(-1, block_m)
    for block, expert in zip(blocks, block_experts.tolist()):
        held = block[block < count]
        if expert == experts:  # unused blocks at the end hold only padding
            assert held.numel() == 0
        else:
            assert (ids.reshape(-1)[held] == expert).all()
    assert (block_experts.diff() >= 0).all()
