"""Runs qrt's passes in order over a Dynamo graph, recording what each did."""

from dataclasses import dataclass, field

import torch.fx

from .base import GraphPass, count_ops, graph_code, graph_modules, input_values
from .fuse_act_quant import FuseActivationQuant
from .swap_attention import SwapDecodeAttention
from .swap_experts import SwapFusedExperts
from .swap_linear import SwapQuantizedLinear

DEFAULT_PASSES: tuple[type[GraphPass], ...] = (SwapQuantizedLinear, SwapFusedExperts, SwapDecodeAttention)
# CUDA graphs also get the passes that emit Triton kernels. On the CPU, Inductor already fuses
# what FuseActivationQuant fuses (the quantization is part of a composite CPU kernel).
CUDA_PASSES: tuple[type[GraphPass], ...] = DEFAULT_PASSES + (FuseActivationQuant,)


def passes_for(device_type: str) -> tuple[type[GraphPass], ...]:
    return CUDA_PASSES if device_type == "cuda" else DEFAULT_PASSES


@dataclass
class PassRecord:
    name: str
    uuid: str
    changed: int
    code_before: str
    code_after: str
    ops_before: dict
    ops_after: dict


@dataclass
class GraphReport:
    """Everything qrt did to one compiled graph; the dump CLI writes it out."""

    label: str
    passes: list[PassRecord] = field(default_factory=list)
    kernel_choices: list = field(default_factory=list)  # per linear (and experts block)
    attention_choices: list = field(default_factory=list)  # per decode-attention call
    loaded: bool = False  # from qrt's compile cache, with its graph, rather than from a Dynamo trace


def run_passes(gm: torch.fx.GraphModule, report: GraphReport, passes=DEFAULT_PASSES, keep_code=True,
               example_inputs=()):
    """Run `passes` in order over `gm` and its subgraphs. example_inputs: the real inputs Dynamo
    compiles `gm` for, from which the passes read what the loader pass recorded on the weights."""
    values = input_values(gm, example_inputs)
    for pass_cls in passes:
        graph_pass = pass_cls()
        before_code = graph_code(gm) if keep_code else ""
        before_ops = count_ops(gm)
        # Like the op counts, a change inside a nested region's body counts once per layer calling it.
        changed = sum(graph_pass.run(graph, report, calls, values) * calls for _, graph, calls in graph_modules(gm))
        report.passes.append(
            PassRecord(graph_pass.name, graph_pass.uuid, changed, before_code,
                       graph_code(gm) if keep_code else "", before_ops, count_ops(gm))
        )
    return gm
