"""Put each mixture-of-experts block's experts kernel in the graph: the one its loader recorded on
the stacked experts' weight (`experts_kernel`, experts.py), in place of `qrt::fused_experts`, the
per-expert loop the layers call.

Like the linear swap pass, it makes no choice of its own: it reads the real stacked weight the graph
is run with and carries out what the loader chose for that layout and device.
"""

import torch
import torch.fx

from qrt.kernels.choices import kernel_named

from .base import GraphPass, target_name
from .swap_linear import KernelChoice, resolve_op

FUSED_EXPERTS = "qrt.fused_experts"


class SwapFusedExperts(GraphPass):
    name = "swap_fused_experts"

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1, values=None) -> int:
        changed = 0
        for node in gm.graph.nodes:
            if node.op != "call_function" or target_name(node.target) != FUSED_EXPERTS:
                continue
            first_weight = node.args[3][0]  # gate_up's first stacked tensor: the weight
            weights = (values or {}).get(first_weight, [])
            kernels = {getattr(w, "experts_kernel", None) for w in weights}
            if len(kernels) > 1:
                raise RuntimeError(f"{node.name}: layers sharing one compiled body were given different experts "
                                   f"kernels {sorted(map(str, kernels))}")
            chosen = kernels.pop() if kernels else None
            example = weights[0] if weights else None
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
            shape = tuple(example.shape) if example is not None else ()
            dtype = str(example.dtype).removeprefix("torch.") if example is not None else "?"
            device = example.device.type if example is not None else "?"
            report.kernel_choices += [KernelChoice(node.name, FUSED_EXPERTS, kernel, reason, shape, dtype, device)] * calls
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
