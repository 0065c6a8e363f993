"""The experts of a mixture-of-experts block: E gated MLPs whose projections are quantized linears.

Experts are one more use of the quantized-linear contract (linear.py), not a second one:

- While loading, each expert is an ordinary pair of `Linear`s (`experts.{e}.gate_up_proj`, shards 0
  and 1 from the checkpoint's gate and up tensors, and `experts.{e}.down_proj`), built with the
  method the scheme gives those checkpoint modules. So every format, its ignore list, its loader
  pass and its tensor-parallel rule apply to experts unchanged, and a checkpoint's one-tensor-per-
  expert layout streams in as it is stored.
- After the loader pass (`finish_loading`), each projection's per-expert parameters are stacked into
  one tensor [E, ...] per parameter (`StackedExperts`), and the per-expert modules are dropped. The
  compiled graph then passes a handful of tensors per layer to `qrt::fused_experts`
  (kernels/experts_reference.py) instead of 3 * E weights.
- The op applies expert e by handing the format's own `LinearMethod.apply` a view of expert e's
  slices (`ExpertSlice`). Its reference (`qrt::fused_experts`, eager) runs the format's logical op;
  in a compiled graph the swap pass puts `qrt::fused_experts_kernels` there, which runs the kernel
  that one expert's loader pass chose (`KernelInPlaceOfLogicalOp`), or a fused experts kernel where
  one reads the layout (`qrt::fused_experts_triton` on CUDA).
"""

import hashlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from qrt.kernels.choices import Kernel, choose, kernel_named
from qrt.kernels.experts_reference import ExpertLayers, ExpertProjection, register_expert_layers

from qrt.errors import UnsupportedError
from qrt.layers.linear import Linear, attributes_of, make_parameter
from qrt.layers.tensor_parallel import SINGLE, Parallelism, all_reduce


class ExpertMLP(nn.Module):
    """One expert while the checkpoint loads: gate and up fused (shards 0 and 1), then down."""

    def __init__(self, hidden: int, intermediate: int, *, checkpoint_prefix: str, names: tuple[str, str, str], scheme,
                 dtype, parallel: Parallelism, bias: bool = False):
        super().__init__()
        gate, up, down = (f"{checkpoint_prefix}.{name}" for name in names)
        part = parallel.even(intermediate, f"{checkpoint_prefix}: the experts' intermediate size")
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias=bias, dtype=dtype, shard_ids=(0, 1),
                                   method=scheme.method_for([gate, up]), parallel=parallel, n_slices=[part, part])
        self.down_proj = Linear(intermediate, [hidden], bias=bias, dtype=dtype, method=scheme.method_for(down),
                                parallel=parallel, k_slice=part)


class ExpertSlice:
    """Expert e's slices of a projection's stacked tensors, read by a LinearMethod's `apply` as if
    they were that expert's Linear: tensors by name, everything else from the template Linear."""

    def __init__(self, template: Linear, names: tuple[str, ...], tensors, expert: int):
        self._template = template
        for name, tensor in zip(names, tensors, strict=True):
            self.__dict__[name] = tensor[expert]

    def __getattr__(self, name):
        return getattr(self._template, name)


class StackedExperts(nn.Module):
    """One projection of every expert after loading: each parameter of the experts' Linears
    stacked along a new dim 0 ([E, ...]), plus a template Linear (expert 0's, without its tensors)
    that carries the format's method and the attributes its `apply` reads."""

    def __init__(self, linears: list[Linear], what: str):
        super().__init__()
        signatures = [_signature(linear) for linear in linears]
        for expert, signature in enumerate(signatures):
            if signature != signatures[0]:
                raise UnsupportedError(f"{what}: expert {expert}'s weights were laid out differently from expert 0's "
                                       f"({signature} against {signatures[0]}); qrt runs all experts with one kernel")
        template = linears[0]
        self.names = tuple(name for name, param in template.named_parameters(recurse=False))
        for name in self.names:
            first = getattr(template, name)
            stacked = torch.stack([getattr(linear, name).data for linear in linears])  # [E, ...]
            layout = getattr(first, "storage_layout", None)
            setattr(self, name, make_parameter(
                stacked, **{**attributes_of(first), "storage_layout": f"{len(linears)} experts x {layout}"}))
        for linear in linears:
            for name in self.names:
                del linear._parameters[name]
        self.__dict__["template"] = template  # not a submodule: its tensors now live here
        self.signature = signatures[0]

    @property
    def quant_method(self):
        return self.template.quant_method

    @property
    def n_slices(self):
        return self.template.n_slices

    @property
    def k_slice(self):
        return self.template.k_slice

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.names]

    def projection(self) -> ExpertProjection:
        """What fused_experts needs to know of these experts. It holds the template only, not this
        module: the op's registry must not keep a model's weights alive."""
        template, names = self.template, self.names

        def apply(expert: int, tensors: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return template.quant_method.apply(ExpertSlice(template, names, tensors, expert), x)

        weight = self.weight
        kernel = getattr(weight, "kernel", None) or "?"
        substitution = KernelInPlaceOfLogicalOp(kernel_named(kernel)) if kernel != "?" else None

        def apply_kernel(expert: int, tensors: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            if substitution is None or not substitution.active:
                return apply(expert, tensors, x)
            with substitution:
                return apply(expert, tensors, x)

        return ExpertProjection(apply, apply_kernel, names, kernel, template.input_size,
                                getattr(weight, "packed_factor", None), getattr(weight, "group_size", None))


class KernelInPlaceOfLogicalOp(TorchFunctionMode):
    """While active, a call of the logical op that `kernel` replaces runs `kernel` instead: what
    the swap pass does to a linear in a compiled graph, done here for the expert linears that run
    inside the experts op, where no graph pass reaches. Inactive for kernels that the layer calls
    itself (opaque layouts) or that replace nothing."""

    def __init__(self, kernel: Kernel):
        super().__init__()
        self.replaced = kernel.replaces
        self.active = kernel.replaces is not None and kernel.op != kernel.replaces
        self.kernel = _op(kernel.op) if self.active else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _op_name(func) == self.replaced:
            return self.kernel(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _op(name: str):
    namespace, op = name.split(".")
    return getattr(getattr(torch.ops, namespace), op)


def _op_name(func) -> str | None:
    """'qrt.fp8_linear' for the op packet or an overload of it, None for anything else."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name.replace("::", ".")
    qualified = getattr(func, "_qualified_op_name", None)
    return qualified.replace("::", ".") if qualified else None


def _signature(linear: Linear) -> tuple:
    """What must agree between experts run by one kernel: the method and its settings, each
    parameter's shape, dtype and recorded kernel, and the plain attributes the loader pass set."""
    method = linear.quant_method
    params = tuple((name, tuple(p.shape), str(p.dtype), getattr(p, "kernel", None), getattr(p, "storage_layout", None))
                   for name, p in linear.named_parameters(recurse=False))
    plain = tuple(sorted((k, v) for k, v in vars(linear).items()
                         if not k.startswith("_") and k != "training" and isinstance(v, (int, float, str, bool))))
    return type(method).__name__, method.name, repr(method.cfg), str(method.layout), params, plain


class FusedExperts(nn.Module):
    """The routed experts of one MoE block: x [T, D], topk_ids / topk_weights [T, k] -> [T, D].
    bias: each projection of each expert has a bias (gpt-oss), stacked [E, N] with its weights."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, checkpoint_prefix: str,
                 names: tuple[str, str, str], scheme, dtype, activation: str, parallel: Parallelism = SINGLE,
                 bias: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.has_bias = bias
        self.activation = activation
        self.parallel = parallel
        self.checkpoint_prefix = checkpoint_prefix
        for expert in range(num_experts):  # children "0".."E-1": the checkpoint's experts.{e}.* names
            self.add_module(str(expert), ExpertMLP(hidden, intermediate, checkpoint_prefix=f"{checkpoint_prefix}.{expert}",
                                                   names=names, scheme=scheme, dtype=dtype, parallel=parallel,
                                                   bias=bias))
        self.name = None  # set by finish_loading: the name fused_experts finds these experts under

    def finish_loading(self, device: torch.device) -> None:
        """After the loader pass: stack the experts' parameters and register them with the op."""
        experts = [self._modules.pop(str(e)) for e in range(self.num_experts)]
        self.gate_up_proj = StackedExperts([e.gate_up_proj for e in experts], f"{self.checkpoint_prefix}.*.gate_up_proj")
        self.down_proj = StackedExperts([e.down_proj for e in experts], f"{self.checkpoint_prefix}.*.down_proj")
        identity = repr((self.num_experts, self.activation, self.gate_up_proj.signature, self.down_proj.signature))
        self.name = f"{self.gate_up_proj.quant_method.name}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
        layers = ExpertLayers(self.gate_up_proj.projection(), self.down_proj.projection())
        register_expert_layers(self.name, layers)
        # The experts' own kernel: the per-expert loop, or a fused one that reads this layout
        # (recorded for the swap pass, like a linear's weight.kernel).
        kernel = choose("qrt.fused_experts", device.type, gate_up=layers.gate_up.kernel, down=layers.down.kernel,
                        bias=self.has_bias)
        self.gate_up_proj.weight.experts_kernel = kernel.op

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.ops.qrt.fused_experts(x, topk_ids, topk_weights, self.gate_up_proj.tensors(),
                                          self.down_proj.tensors(), self.name, self.activation)
        # Each rank holds a slice of every expert's intermediate features: its down projections
        # are partial sums, added once for the whole block.
        return all_reduce(out, self.parallel) if self.parallel.sharded else out
