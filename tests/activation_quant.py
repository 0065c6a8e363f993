"""The activation rounding of W8A8 and FP8 formats, for the dequantized reference models.

A format that quantizes activations rounds each quantized linear's input before the matmul. A
reference that only dequantizes the weights then differs from qrt by that rounding (~10% on the
tiny, deliberately sharp test models), a bound so loose that a misplaced scale passes. Here the
transformers reference rounds the same inputs the same way, written from the formats'
definitions in plain torch (not qrt's code), so what is left between the two is a value lying on a
rounding edge, which one side rounds up and the other down.

`rounded_inputs(model, rounding)` rounds the input of every `F.linear` in `model` except those of
the weights listed as unquantized (routers, lm_head), experts included: transformers' "eager" experts
loop runs each expert as `F.linear` on a slice of its stacked weight."""

import copy
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

E4M3_MAX = 448.0
INT8_MAX = 127.0


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """e4m3 with one scale per row (amax / 448), dequantized: [..., K] fp32."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def fp8_per_group(group: int):
    """e4m3 with one scale per row per `group` consecutive input channels (the last group may be partial)."""
    def rounding(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([fp8_per_token(part) for part in x.float().split(group, dim=-1)], dim=-1)
    return rounding


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per row (amax / 127), round half to even, dequantized."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / INT8_MAX
    return (x.float() / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale


class _RoundLinearInputs(TorchFunctionMode):
    def __init__(self, rounding, skipped_storages: set[int]):
        super().__init__()
        self.rounding, self.skipped = rounding, skipped_storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight, *rest = args
            if weight.untyped_storage().data_ptr() not in self.skipped:
                args = (self.rounding(x).to(x.dtype), weight, *rest)
        return func(*args, **kwargs)


# Modules the formats leave unquantized: the lm_head, MoE routers and Qwen2-MoE's shared-expert gate.
UNQUANTIZED = ("lm_head", ".gate", "shared_expert_gate")


def with_rounded_weights(model: torch.nn.Module, rounding) -> torch.nn.Module:
    """A copy of `model` whose decoder-layer weights (2-D, or stacked experts [E, N, K]) but the
    unquantized ones go through `rounding` row by row: one scale per output channel."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            module = name.removesuffix(".weight")
            if name.startswith("model.layers.") and param.dim() >= 2 and not module.endswith(UNQUANTIZED):
                param.copy_(rounding(param))
    return rounded


@contextmanager
def rounded_inputs(model: torch.nn.Module, rounding):
    """Within the block, every linear of `model` but the unquantized ones sees its input through
    `rounding` (None: the block runs as it is, for formats that keep activations as they are)."""
    if rounding is None:
        yield
        return
    skipped = {module.weight.untyped_storage().data_ptr() for name, module in model.named_modules()
               if getattr(module, "weight", None) is not None and name.endswith(UNQUANTIZED)}
    if hasattr(model, "set_experts_implementation"):
        # transformers' default for stacked experts is a grouped matmul; its "eager" loop runs
        # each expert as F.linear, which the mode sees.
        model.set_experts_implementation("eager")
    with _RoundLinearInputs(rounding, skipped):
        yield
