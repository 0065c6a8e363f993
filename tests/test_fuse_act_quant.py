"""The fuse_act_quant pass on Dynamo graphs: ops counted before and after, and the fused graph
computing what the unfused one does (Triton ops interpreted on the CPU). The graphs come from a
small module written like the models' layers and from the tiny W8A8 model itself, with the int8
op targeted at its Triton kernel as the swap pass does on CUDA."""

import copy

import pytest
import torch
from torch import nn

import qrt.kernels.int8_fused_triton  # noqa: F401  (registers the Triton ops)
import qrt.kernels.int8_triton  # noqa: F401
import qrt.kernels.w4a8_triton  # noqa: F401
from helpers.checkpoints.tiny import random_ids
from helpers.checkpoints.w8a8 import make_ct_w8a8_checkpoint
from helpers.compare import relative_l2
from helpers.graph_checks import qrt_op_counts
from qrt import runtime
from qrt.kernels.int8_reference import weight_row_sums
from qrt.kernels.int_reference import pack_rows
from qrt.passes.base import count_ops, graph_modules
from qrt.passes.fuse_act_quant import FuseActivationQuant
from qrt.passes.manager import passes_for
from qrt.runtime.models.layers import RMSNorm


def capture(fn, *args):
    """Dynamo's graph of fn(*args) (fullgraph) and the real inputs it is called with."""
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"] = gm

        def run(*inputs):
            captured["inputs"] = inputs
            return gm.forward(*inputs)

        return run

    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return captured["gm"], captured["inputs"]


def fuse(gm):
    fused = copy.deepcopy(gm)
    changed = FuseActivationQuant().run(fused, None)
    return fused, changed


class Block(nn.Module):
    """norm -> int8 gate_up -> silu * up -> int8 down, and a second norm -> W4A8 projection,
    through the ops the models call (qrt::rms_norm, qrt::act_mul)."""

    def __init__(self, dtype, asymmetric_down=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        d, inter = 64, 96
        self.norm, self.norm2 = RMSNorm(d, 1e-5, dtype), RMSNorm(d, 1e-6, dtype)
        for norm in (self.norm, self.norm2):
            norm.weight.data.copy_(torch.randn(d, generator=gen) * 0.1 + 1)
        self.w_up = torch.randint(-127, 128, (2 * inter, d), generator=gen, dtype=torch.int8)
        self.s_up = torch.rand(2 * inter, generator=gen) * 0.01
        self.w_down = torch.randint(-127, 128, (d, inter), generator=gen, dtype=torch.int8)
        self.s_down = torch.rand(d, generator=gen) * 0.01
        self.sums_down = weight_row_sums(self.w_down) if asymmetric_down else None
        self.qweight = pack_rows(torch.randint(0, 16, (d, 32), generator=gen), 4)  # [d / 8, 32]
        self.group_scales = (torch.rand(1, 32, generator=gen) * 10 + 1).half().float()
        self.channel_scales = torch.rand(32, generator=gen) * 1e-3

    def forward(self, x):
        gate, up = torch.ops.qrt.int8_linear_triton(self.norm(x), self.w_up, self.s_up, None, None, None,
                                                    None).chunk(2, dim=-1)
        h = x + torch.ops.qrt.int8_linear_triton(torch.ops.qrt.act_mul(torch.cat([gate, up], -1), "silu"),
                                                 self.w_down, self.s_down, None, None, self.sums_down, None)
        return torch.ops.qrt.w4a8_linear_triton(self.norm2(h), self.qweight, self.group_scales, self.channel_scales,
                                                None, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_silu_mul_quantization_fuse_and_compute_the_same(dtype):
    block = Block(dtype)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    gm, inputs = capture(block, x)
    assert qrt_op_counts(gm) == {"qrt.int8_linear_triton": 2, "qrt.w4a8_linear_triton": 1, "qrt.rms_norm": 2,
                           "qrt.act_mul": 1}
    fused, changed = fuse(gm)
    assert changed == 3
    assert qrt_op_counts(fused) == {"qrt.rms_norm_quant_int8_triton": 2, "qrt.silu_mul_quant_int8_triton": 1,
                              "qrt.int8_gemm_triton": 2, "qrt.w4a8_gemm_triton": 1}
    before, after = count_ops(gm), count_ops(fused)
    # Gone: both norm ops and the activation op, each computed by its fused kernel instead.
    assert before["qrt.rms_norm"] == 2 and before["qrt.act_mul"] == 1
    assert "qrt.rms_norm" not in after and "qrt.act_mul" not in after
    with torch.no_grad():
        expected, got = gm(*inputs)[0], fused(*inputs)[0]
    # Same roundings in the same order; only exp, the mean and rsqrt may differ in the last bit,
    # which can move a code on a rounding edge by one.
    assert relative_l2(got, expected) < 1e-3


def test_what_is_not_fused():
    """Asymmetric activations (the fused kernels are symmetric), a norm whose output has a second
    user, and an activation other than silu keep their unfused form."""
    block = Block(torch.float32, asymmetric_down=True)

    def shared_norm(x):
        h = block.norm(x)
        return torch.ops.qrt.int8_linear_triton(h, block.w_up, block.s_up, None, None, None, None), h

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    gm, _ = capture(block, x)
    fused, changed = fuse(gm)
    assert changed == 2  # norm -> gate_up and norm2 -> W4A8; the asymmetric down_proj stays
    assert qrt_op_counts(fused)["qrt.int8_linear_triton"] == 1
    gm, _ = capture(shared_norm, x)
    assert fuse(gm)[1] == 0

    def gelu_mlp(y):
        return torch.ops.qrt.int8_linear_triton(torch.ops.qrt.act_mul(y, "gelu_pytorch_tanh"), block.w_down,
                                                block.s_down, None, None, None, None)

    gm, _ = capture(gelu_mlp, torch.randn(3, 192, generator=torch.Generator().manual_seed(4)))
    assert fuse(gm)[1] == 0


def test_the_gemma_norm_fuses_too():
    """Gemma's (1 + w) norm is qrt::rms_norm with unit_offset: it fuses, with its own rounding."""
    from qrt.runtime.models.gemma import GemmaRMSNorm

    block = Block(torch.bfloat16)
    norm = GemmaRMSNorm(64, 1e-6, torch.bfloat16)
    norm.weight.data.copy_(torch.randn(64, generator=torch.Generator().manual_seed(5)) * 0.1)

    def gemma_proj(x):
        return torch.ops.qrt.int8_linear_triton(norm(x), block.w_up, block.s_up, None, None, None, None)

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    gm, inputs = capture(gemma_proj, x)
    fused, changed = fuse(gm)
    assert changed == 1 and qrt_op_counts(fused)["qrt.rms_norm_quant_int8_triton"] == 1
    fused_node = next(n for n in fused.graph.nodes if n.target is torch.ops.qrt.rms_norm_quant_int8_triton.default)
    assert fused_node.args[3] is True
    with torch.no_grad():
        assert relative_l2(fused(*inputs)[0], gm(*inputs)[0]) < 1e-3


def test_the_pass_runs_on_cuda_graphs_only():
    assert FuseActivationQuant in passes_for("cuda") and FuseActivationQuant not in passes_for("cpu")


@pytest.mark.parametrize("layers_once", [False, True], ids=["inlined-layers", "nested-region-layers"])
def test_fuses_the_tiny_w8a8_model_graph(tmp_path, layers_once):
    """On the real model graph: q/k/v and gate/up follow RMSNorms, down_proj follows silu * up;
    o_proj follows attention and keeps its own quantization. With the layers in a nested compile
    region the pass rewrites the one body both layers call, as the backend runs it."""
    make_ct_w8a8_checkpoint(tmp_path / "ckpt")
    model = runtime.compile_model(tmp_path / "ckpt", compile=False, progress=False, max_seq_len=32).model
    model.compile_layers_once = layers_once
    ids = random_ids(3, (2, 8))
    gm, inputs = capture(lambda m, i: m(i), model, ids)
    assert len(graph_modules(gm)) == (2 if layers_once else 1)
    for _, graph, _ in graph_modules(gm):  # what the swap pass does on CUDA
        for node in graph.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.qrt.int8_linear:
                node.target = torch.ops.qrt.int8_linear_triton
        graph.recompile()
    fused = copy.deepcopy(gm)
    changed = sum(FuseActivationQuant().run(graph, None, calls) * calls for _, graph, calls in graph_modules(fused))
    assert changed == 6
    assert qrt_op_counts(fused) == {"qrt.rms_norm_quant_int8_triton": 4, "qrt.silu_mul_quant_int8_triton": 2,
                              "qrt.int8_gemm_triton": 6, "qrt.int8_linear_triton": 2,
                              "qrt.rms_norm": 1}  # the final norm feeds the dense lm_head
    with torch.no_grad():
        assert relative_l2(fused(*inputs)[0], gm(*inputs)[0]) < 1e-5
