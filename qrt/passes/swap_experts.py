"""Put each mixture-of-experts block's experts kernel in the graph: the one its loader recorded on
the stacked experts' weight (`experts_kernel`, experts.py), in place of `qrt::fused_experts`, the
reference the layers call (each expert through its format's logical ops). On the CPU that is
`qrt::fused_experts_kernels` (each expert through the kernel its weights were laid out for), on
CUDA `qrt::fused_experts_triton` where it reads the layout.

Like the linear swap pass, it makes no choice of its own: it reads the real stacked weight the graph
is run with and carries out what the loader chose for that layout and device.
"""

import torch
import torch.fx

from qrt.kernels.choices import kernel_named

from .base import GraphPass, target_name
from .swap_linear import KernelChoice, recorded_kernel, resolve_op, weight_facts

FUSED_EXPERTS = "qrt.fused_experts"


class SwapFusedExperts(GraphPass):
    name = "swap_fused_experts"

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1, values=None) -> int:
        changed = 0
        for node in gm.graph.nodes:
            if node.op != "call_function" or target_name(node.target) != FUSED_EXPERTS:
                continue
            # The stacked gate_up tensor that carries the record: the weight, wherever the format
            # put it among its parameters.
            stacked = [value for operand in node.args[3] for value in (values or {}).get(operand, [])]
            weights = [value for value in stacked if getattr(value, "experts_kernel", None) is not None]
            chosen = recorded_kernel(weights, "experts_kernel")
            if chosen is None:
                kernel, reason = FUSED_EXPERTS, "no experts kernel recorded by the loader; kept the op as called"
            else:
                declared = kernel_named(chosen)
                kernel, reason = declared.op, declared.why
                if declared.op != FUSED_EXPERTS:
                    op = resolve_op(declared.op)
                    if op is None:
                        raise RuntimeError(f"{node.name}: the loader chose {declared.op}, which is not registered in "
                                           f"this process (is Triton installed?)")
                    node.target = op
                    changed += 1
            shape, dtype, device = weight_facts(weights)
            report.kernel_choices += [KernelChoice(node.name, FUSED_EXPERTS, kernel, reason, shape, dtype, device)] * calls
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
