"""Hand a kernel its input already quantized, by the op that computes that input: the fusions the
kernel declares (`Kernel.fusions`, qrt/kernels/choices.py).

Runs on CUDA graphs, after the swap pass. A Triton int8 kernel (`int8_linear_triton` with dynamic
symmetric activations, or `w4a8_linear_triton`) quantizes its own input: the activation is written
in the model dtype by the norm (or activation) kernel and read back by the quantization kernel.
When that input is a `qrt::rms_norm` or `qrt::act_mul` (silu) whose result feeds nothing else, the
pass replaces

    h = qrt.rms_norm(x, w, eps, unit_offset)  ->  q, s = rms_norm_quant_int8_triton(x, w, eps, unit_offset)
    y = int8_linear_triton(h, W, ...)             y = int8_gemm_triton(q, s, W, ...)

so the activation leaves its kernel as int8 with one scale per token: half the bytes of bf16, one
kernel launch fewer, identical numerics (the fused kernels make every rounding the unfused graph
makes).

Not on the CPU: there the W8A8 kernel is a composite op, so Inductor already generates the
quantization in the same loops as the norm around one ATen matmul; this pass would have nothing
to add. The producers are ops the models call, so the pass matches an op, not a copy of its code.
"""

import operator

import torch
import torch.fx

from qrt.kernels.choices import declared

from .base import GraphPass, target_name
from .swap_linear import resolve_op


def _value(node):
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


class FuseActivationQuant(GraphPass):
    name = "fuse_act_quant"

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1, values=None) -> int:
        changed = 0
        graph = gm.graph
        fusable = {op: kernel.fusions for op, kernel in declared().items() if kernel.fusions}
        for node in list(graph.nodes):
            fusions = fusable.get(target_name(node.target)) if node.op == "call_function" else None
            x = node.args[0] if fusions else None
            if not isinstance(x, torch.fx.Node) or x.op != "call_function" or len(x.users) != 1:
                continue
            producer = target_name(x.target)
            fusion = next((f for f in fusions if f.producer == producer), None)
            if fusion is None:
                continue
            producer_args, gemm_args = fusion.producer_args(x.args), fusion.gemm_args(node.args)
            if producer_args is None or gemm_args is None or _value(node) is None:
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(resolve_op(fusion.fused_producer).default, tuple(producer_args))
                q = graph.call_function(operator.getitem, (fused, 0))
                scale = graph.call_function(operator.getitem, (fused, 1))
                new = graph.call_function(resolve_op(fusion.gemm).default, (q, scale, *gemm_args, _value(node).dtype))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            graph.erase_node(x)
            changed += 1
        if changed:
            graph.lint()
            gm.recompile()
        return changed
