"""Put each layer's decode-attention kernel in the graph: the one chosen for its KV cache when the
cache was allocated (`attention_kernel` on the K cache, models/layers.py), in place of
`qrt::decode_attention`, the reference the layers call. On a CPU with AVX-512 that is qrt's own
kernel (qrt/kernels/decode_attention_cpu.py).

Like the linear swap pass, it makes no choice of its own: it reads the real cache the graph runs
with and carries out what was recorded on it.
"""

import torch
import torch.fx

from qrt.kernels.choices import kernel_named

from .base import GraphPass, target_name
from .swap_linear import KernelChoice, recorded_kernel, resolve_op, weight_facts

DECODE_ATTENTION = "qrt.decode_attention"


class SwapDecodeAttention(GraphPass):
    name = "swap_decode_attention"

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1, values=None) -> int:
        changed = 0
        for node in gm.graph.nodes:
            if node.op != "call_function" or target_name(node.target) != DECODE_ATTENTION:
                continue
            caches = (values or {}).get(node.args[1], [])  # the K cache of each layer calling this body
            chosen = recorded_kernel(caches, "attention_kernel")
            if chosen is None:
                kernel, reason = DECODE_ATTENTION, "no attention kernel recorded on the cache; kept the op as called"
            else:
                declared = kernel_named(chosen)
                kernel, reason = declared.op, declared.why
                if declared.op != DECODE_ATTENTION:
                    op = resolve_op(declared.op)
                    if op is None:
                        raise RuntimeError(f"{node.name}: {declared.op} was chosen for this cache, and is not "
                                           f"registered in this process")
                    node.target = op
                    changed += 1
            shape, dtype, device = weight_facts(caches)
            choice = KernelChoice(node.name, DECODE_ATTENTION, kernel, reason, shape, dtype, device)
            report.attention_choices += [choice] * calls
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
