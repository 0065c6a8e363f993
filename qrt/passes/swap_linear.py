"""Put each quantized layer's kernel in the graph: the one its loader pass chose and recorded on the
weight (`weight.kernel`, from the declarations in qrt/kernels/choices.py).

A layer calls its logical op (the reference) or, for an opaque layout no reference can read, its
kernel op itself. For every such call the pass reads the real weight the graph is run with; where
the layer called the op that its kernel `replaces`, the kernel takes its place. The pass makes no
choice of its own, so it cannot disagree with the layout the loader made.
"""

from dataclasses import dataclass

import torch
import torch.fx

from qrt.kernels.choices import kernel_named, linear_ops

from .base import GraphPass, target_name


@dataclass
class KernelChoice:
    node: str  # FX node name, which encodes the layer path
    logical_op: str  # the op the layer called
    kernel: str  # the op the graph runs
    reason: str
    weight_shape: tuple
    weight_dtype: str
    device: str


def resolve_op(name: str):
    """The op packet for 'ns.op', or None when it is not registered (e.g. Triton missing)."""
    namespace, op = name.split(".")
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except AttributeError:
        return None


def recorded_kernel(weights: list, attribute: str = "kernel") -> str | None:
    """The kernel the loader pass recorded (as `attribute`) on a call's weights (one per layer
    calling a nested region's body), or None when they carry none. Layers sharing a body must agree."""
    kernels = {getattr(w, attribute, None) for w in weights}
    if len(kernels) > 1:
        raise RuntimeError(f"layers sharing one compiled body were given different kernels {sorted(map(str, kernels))}"
                           f"; their weights have the same shapes but different layouts")
    return kernels.pop() if kernels else None


def weight_facts(weights: list) -> tuple[tuple, str, str]:
    """(shape, dtype, device type) of a call's first weight, for the report; unknown ones blank."""
    if not weights:
        return (), "?", "?"
    example = weights[0]
    return tuple(example.shape), str(example.dtype).removeprefix("torch."), example.device.type


class SwapQuantizedLinear(GraphPass):
    name = "swap_quantized_linear"

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1, values=None) -> int:
        changed = 0
        ops = linear_ops()
        for node in gm.graph.nodes:
            called = target_name(node.target) if node.op == "call_function" else None
            if called not in ops:
                continue
            weight_node = node.args[1]
            weights = (values or {}).get(weight_node, [])
            chosen = recorded_kernel(weights)
            shape, dtype, device = weight_facts(weights)
            if chosen is None:
                kernel, reason = called, "no kernel recorded on the weight by a loader pass; kept the op as called"
            else:
                declared = kernel_named(chosen)
                kernel, reason = declared.op, declared.why
                if called not in (declared.op, declared.replaces):
                    raise RuntimeError(f"{node.name}: the loader pass chose {declared.op} for this layer, whose graph "
                                       f"calls {called}; {declared.op} replaces {declared.replaces}")
                if called != declared.op:
                    op = resolve_op(declared.op)
                    if op is None:
                        raise RuntimeError(f"{node.name}: the loader pass chose {declared.op}, which is not registered "
                                           f"in this process (is Triton installed?)")
                    node.target = op
                    changed += 1
            # One choice per layer: a nested region's body stands for every layer that calls it.
            report.kernel_choices += [KernelChoice(node.name, called, kernel, reason, shape, dtype, device)] * calls
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
