"""The activation rounding of W8A8, FP8 and NVFP4 formats, for the dequantized reference models.

A format that quantizes activations rounds each quantized linear's input before the matmul. A
reference that only dequantizes the weights then differs from qrt by that rounding (~10% on the
tiny, deliberately sharp test models), a bound so loose that a misplaced scale passes. Here the
transformers reference rounds the same inputs the same way, written from the formats'
definitions in plain torch (not qrt's code), so what is left between the two is a value lying on a
rounding edge, which one side rounds up and the other down.

`rounded_inputs(model, rounding)` rounds the input of every `F.linear` in `model` except those of
the weights listed as unquantized (routers, lm_head), experts included: transformers' "eager" experts
loop runs each expert as `F.linear` on a slice of its stacked weight. Given a dict of parameter names
instead, it rounds each of those weights' inputs its own way (static scales, a rank's part of a row).
`fp8_kv_cache(model, scales)` rounds each attention layer's keys and values (after RoPE, as a
cache stores them) to e4m3 with that layer's static scales."""

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


def fp8_static(scale: float):
    """e4m3 with one fixed scale (a checkpoint's input_scale), dequantized."""
    def rounding(x: torch.Tensor) -> torch.Tensor:
        return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return rounding


def int8_per_group(group: int):
    """int8_per_token over each `group` consecutive input channels (a tensor-parallel rank's part of
    a row, which that rank quantizes with its own range)."""
    def rounding(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([int8_per_token(part) for part in x.float().split(group, dim=-1)], dim=-1)
    return rounding


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per row (amax / 127), round half to even, dequantized."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / INT8_MAX
    return (x.float() / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 E2M1's values >= 0, code order


def nvfp4_static_global(global_scale: float):
    """NVFP4 activations (compressed-tensors' float 4-bit "tensor_group" args, group 16, dynamic
    "local"): each run of 16 input channels gets the block scale e4m3(global x amax / 6) (0: e4m3's
    epsilon, 0.125), and each value the E2M1 value nearest to x / (scale / global), a tie to the
    even code, times scale / global: [..., K] fp32."""
    def rounding(x: torch.Tensor) -> torch.Tensor:
        g = torch.tensor(global_scale, dtype=torch.float32)
        groups = x.float().unflatten(-1, (-1, 16))  # [..., K / 16, 16]
        scale = (g * (groups.abs().amax(dim=-1, keepdim=True) / 6)).clamp(-E4M3_MAX, E4M3_MAX)
        scale = scale.to(torch.float8_e4m3fn).float()
        scale = torch.where(scale == 0, torch.full_like(scale, 0.125), scale) / g
        scaled = (groups / scale).clamp(-6, 6)
        grid = torch.tensor(E2M1_MAGNITUDES)
        distance = (scaled.abs()[..., None] - grid).abs()  # [..., K / 16, 16, 8]
        nearest = distance == distance.amin(dim=-1, keepdim=True)
        # Of two equally near neighbours the one with the even code (0, 1, 2, 4) wins.
        even = nearest & (torch.arange(8) % 2 == 0)
        pick = torch.where(even.any(dim=-1), even.int().argmax(dim=-1), nearest.int().argmax(dim=-1))
        return (grid[pick] * scaled.sign() * scale).flatten(-2)
    return rounding


def with_int8_lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its lm_head weight rounded to int8 per output channel (int8_per_token on its
    rows), as online fp8 stores it; a tied lm_head gets a copy of its own, the embeddings keep the
    rows as stored. Changed in place."""
    weight = model.lm_head.weight.detach()
    model.lm_head.weight = torch.nn.Parameter(int8_per_token(weight).to(weight.dtype))
    return model


def _address(view: torch.Tensor) -> tuple[int, int]:
    """Where a slice of a stacked parameter lies: (its storage, its first element)."""
    return view.untyped_storage().data_ptr(), view.data_ptr()


class _RoundLinearInputs(TorchFunctionMode):
    """Rounds F.linear's input by its weight's address (_address: one expert of a stacked
    parameter), else by its storage (every slice of stacked experts shares it): `by_storage` maps
    either to its rounding (None: left as it is), `default` rounds the rest."""

    def __init__(self, by_storage: dict, default, outputs):
        super().__init__()
        self.by_storage, self.default, self.outputs = by_storage, default, outputs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight, *rest = args
            rounding = self.by_storage.get(_address(weight), self.by_storage.get(
                weight.untyped_storage().data_ptr(), self.default))
            if rounding is not None:
                out = func(rounding(x).to(x.dtype), weight, *rest, **kwargs)
                return out if self.outputs is None else self.outputs(out).to(out.dtype)
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
def rounded_inputs(model: torch.nn.Module, rounding, outputs=None):
    """Within the block, the linears of `model` see their input through `rounding`: a function for
    every linear but the unquantized ones; a dict {parameter name: function} for those weights
    only, where a key (name, e) stands for expert e of a stacked [E, N, K] parameter alone; or
    None (the block runs as it is, for formats that keep activations as they are).
    `outputs`, if given, rounds what those linears return (a kernel's own rounding of its sums)."""
    if rounding is None:
        yield
        return
    # Tied weights too (a tied lm_head is only listed under its own name with remove_duplicate=False).
    parameters = dict(model.named_parameters(remove_duplicate=False))
    if callable(rounding):
        by_storage = {param.untyped_storage().data_ptr(): None for name, param in parameters.items()
                      if name.removesuffix(".weight").endswith(UNQUANTIZED)}
        default = rounding
    else:
        by_storage = {_address(parameters[key[0]][key[1]]) if isinstance(key, tuple)
                      else parameters[key].untyped_storage().data_ptr(): fn for key, fn in rounding.items()}
        default = None
    if hasattr(model, "set_experts_implementation"):
        # transformers' default for stacked experts is a grouped matmul; its "eager" loop runs
        # each expert as F.linear, which the mode sees.
        model.set_experts_implementation("eager")
    with _RoundLinearInputs(by_storage, default, outputs):
        yield


@contextmanager
def fp8_kv_cache(model: torch.nn.Module, scales: dict[int, tuple[float, float]]):
    """Within the block, the attention of layer i in `model` (a transformers model) sees its keys
    and values rounded by fp8_static with scales[i] = (k_scale, v_scale): what an e4m3 KV cache
    with static scales holds. Keys come to the attention function after RoPE, before any
    repetition for grouped-query attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        key, value = fp8_static(k_scale)(key).to(key.dtype), fp8_static(v_scale)(value).to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("fp8_kv_cache_reference", attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("fp8_kv_cache_reference")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


# How far apart two correct runs land, at most, in units of the largest move that reference_drift
# sees: the bound a whole-model test of a format with rounded activations puts on qrt's distance
# from its reference.
DRIFT_FACTOR = 4
# Runs with nudged embeddings, besides the float64 one. On the tiny Gemma 3 one nudge in eight
# flips an activation's rounding (and moves its logits by 1.5e-2); the other seven move them by 2e-7.
NUDGES = 8


def nudged(embeddings: torch.Tensor, seed: int) -> torch.Tensor:
    """`embeddings` with each value moved by about one float32 ulp (relative 2**-24 x N(0, 1)),
    a perturbation no larger than a different order of float32 sums makes."""
    noise = torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (embeddings.double() * (1 + noise * 2.0 ** -24)).to(embeddings.dtype)


def reference_drift(run) -> float:
    """How far a reference's logits move under changes of arithmetic alone: `run(dtype, seed)`
    gives its logits computed in `dtype` with its embeddings nudged by `seed` (0: not nudged).
    The largest relative L2 move over a float64 run and NUDGES nudged float32 runs.

    With activations rounded to e4m3 (3 significant bits), or int8, a model's logits are chaotic:
    an input within summation noise of a rounding edge goes one way in one run and the other way
    in the next, a whole step, and the difference grows through the layers. Such flips are rare
    events on a small model, so one perturbation may see none: hence several. Any two correct runs
    differ by about the largest move, so it, not the order of sums, sets how close qrt can come to
    the reference."""
    base = run(torch.float32, 0).double()
    moves = [run(torch.float64, 0).double()] + [run(torch.float32, seed).double() for seed in range(1, NUDGES + 1)]
    return max(float((moved - base).norm() / base.norm()) for moved in moves)


def model_drift(model: torch.nn.Module, rounding, ids: torch.Tensor) -> float:
    """reference_drift of a float32 transformers model whose linear inputs `rounding` rounds."""
    wide = copy.deepcopy(model).double()

    def run(dtype, seed):
        reference = wide if dtype == torch.float64 else model
        embeddings = reference.get_input_embeddings()(ids)
        if seed:
            embeddings = nudged(embeddings, seed)
        with torch.no_grad(), rounded_inputs(reference, rounding):
            return reference(inputs_embeds=embeddings).logits

    return reference_drift(run)
