"""`qrt::fused_experts`: the routed experts of a mixture-of-experts block, as one op.

    out[t] = sum_j topk_weights[t, j] * down_e(act(gate_up_e(x[t])))   with e = topk_ids[t, j]

Each expert is a gated MLP whose two projections are quantized linears of the checkpoint's format.
The op receives the experts' weights stacked, one tensor [E, ...] per parameter of a projection,
and a name (`experts`) under which the loader registered how one expert's slice of those tensors
is applied: the format's own linear (layers/experts.py). So every format that runs a linear layer
runs experts. Two ops share the loop:
- `qrt::fused_experts`, the reference the layers call (and eager mode runs): each expert through
  its format's logical ops;
- `qrt::fused_experts_kernels`, which the swap pass puts in compiled graphs: each expert through
  the kernel its loader pass chose (ATen's int4/int8 packs on the CPU, oneDNN for dense ones).
On CUDA a grouped Triton GEMM can take their place (experts_triton.py).

The routing is data, not control flow: to the compiled graph the op is opaque (an extern call with
a fixed output shape), so which experts a token picks never causes a recompile or a graph break.
Inside, tokens are grouped by expert and each expert that received tokens runs once on all of them:
decode reads only the selected experts' weights.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from .activation_reference import act_mul
from .choices import Kernel, declare
from .layouts import NamedLayout


@dataclass(frozen=True)
class ExpertProjection:
    """How one projection (gate_up or down) of a block's experts is stored and applied.

    apply(expert index, stacked tensors, x [n, K]) -> [n, N]: the format's linear on one expert's
    slices, through its logical op; apply_kernel: the same through the kernel its loader pass chose. names: the stacked tensors' parameter names, in the order the op receives them; kernel:
    the linear kernel the loader pass chose for one expert's weights (its layout is what a fused
    kernel must read); input_size: K; packed_factor and group_size: the weight's, where its layout
    packs codes along K in groups."""

    apply: Callable[[int, list, torch.Tensor], torch.Tensor]
    apply_kernel: Callable[[int, list, torch.Tensor], torch.Tensor]  # the same through the chosen kernel
    names: tuple[str, ...]
    kernel: str
    input_size: int
    packed_factor: int | None = None
    group_size: int | None = None

    def tensor(self, tensors: list, name: str) -> torch.Tensor | None:
        return tensors[self.names.index(name)] if name in self.names else None


@dataclass(frozen=True)
class ExpertLayers:
    gate_up: ExpertProjection
    down: ExpertProjection


_EXPERT_LAYERS: dict[str, ExpertLayers] = {}


def register_expert_layers(name: str, layers: ExpertLayers) -> None:
    """Make `name` usable as fused_experts' `experts` argument. Layers whose experts share a name
    must be interchangeable (same format, layout and shapes): a compiled layer body bakes the name
    in and runs it for every layer that calls it."""
    _EXPERT_LAYERS[name] = layers


def expert_layers(name: str) -> ExpertLayers:
    try:
        return _EXPERT_LAYERS[name]
    except KeyError:
        raise KeyError(f"no experts registered as {name!r}; the model's loader registers them") from None


@torch.library.custom_op("qrt::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: list[torch.Tensor],
                  down: list[torch.Tensor], experts: str, activation: str) -> torch.Tensor:
    """x: [T, D]; topk_ids: [T, k] int64; topk_weights: [T, k] float. Returns [T, D] in x's dtype,
    summed in fp32. Each expert runs through its format's logical ops (the reference)."""
    return run_experts(x, topk_ids, topk_weights, gate_up, down, expert_layers(experts), activation, kernels=False)


@torch.library.custom_op("qrt::fused_experts_kernels", mutates_args=())
def fused_experts_kernels(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          gate_up: list[torch.Tensor], down: list[torch.Tensor], experts: str,
                          activation: str) -> torch.Tensor:
    """fused_experts with each expert through the kernel its loader pass chose for its weights,
    where the reference runs that kernel's logical op (what the swap pass does to a linear)."""
    return run_experts(x, topk_ids, topk_weights, gate_up, down, expert_layers(experts), activation, kernels=True)


@fused_experts.register_fake
def _(x, topk_ids, topk_weights, gate_up, down, experts, activation):
    return torch.empty_like(x)


@fused_experts_kernels.register_fake
def _(x, topk_ids, topk_weights, gate_up, down, experts, activation):
    return torch.empty_like(x)


def run_experts(x, topk_ids, topk_weights, gate_up, down, layers: ExpertLayers, activation: str, *,
                kernels: bool) -> torch.Tensor:
    """The loop both ops share: tokens grouped by expert, each expert that received tokens run once
    on all of them."""
    up_proj, down_proj = layers.gate_up, layers.down
    apply_up = up_proj.apply_kernel if kernels else up_proj.apply
    apply_down = down_proj.apply_kernel if kernels else down_proj.apply
    tokens, k = topk_ids.shape
    out = torch.zeros(tokens, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, D]
    if tokens == 1:  # one sequence's decode step: no grouping to do, each chosen expert runs on x
        for expert, weight in zip(topk_ids[0].tolist(), topk_weights[0].float().tolist()):
            hidden = act_mul(apply_up(expert, gate_up, x), activation)  # [1, I]
            out += apply_down(expert, down, hidden).float() * weight
        return out.to(x.dtype)
    num_experts = gate_up[0].shape[0]
    flat_ids = topk_ids.reshape(-1)  # [T * k]
    order = torch.argsort(flat_ids, stable=True)  # routed pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    weights = topk_weights.reshape(-1).float()  # [T * k]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]  # [n] indices into the T * k routed pairs
        start += count
        rows = pairs // k  # [n] the tokens routed to this expert
        hidden = act_mul(apply_up(expert, gate_up, x.index_select(0, rows)), activation)  # [n, I]
        y = apply_down(expert, down, hidden)  # [n, D]
        out.index_add_(0, rows, y.float() * weights[pairs, None])
    return out.to(x.dtype)


declare(Kernel(
    "qrt.fused_experts_kernels", devices=("cpu", "cuda"), serves=("qrt.fused_experts",), replaces="qrt.fused_experts",
    layout=NamedLayout("any"), preference=100,
    why="each expert that received tokens runs once on all of them, through the kernel its own weights were "
        "laid out for"))
