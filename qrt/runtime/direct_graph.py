"""A compiled graph called without Dynamo: every step graph (prefill, decode, the speculative
check), and, from qrt's compile cache, graphs that were never traced in this process.

Every call of a `torch.compile`d function goes through Dynamo first: its cache lookup evaluates a
guard on each of a few hundred weight and cache tensors, its bytecode gathers them from the
module tree again, and only then does the compiled graph run. On a one-token int4 decode step of
the default model that was 1.3 ms of 7.1 (`bench/profiles/profile_decode.py`, docs/cpu-kernels.md). qrt builds every
input of its step graphs itself, so it can hold the guarantees the guards gave instead:

- the weights and caches are the tensors the graph was compiled for: they are held here by name,
  checked once against what the graph was traced with (dtype, shape, strides, device), and qrt
  never replaces them (weights are loaded once; the caches are written in place);
- the per-step tensors have the dtypes and static sizes they had when the graph was traced, and
  each dynamic size (a symbol of the trace: the attended length, a prompt chunk's length) is the
  same wherever it appears and stays in the range it was traced for. `DirectGraph.__call__`
  checks these and raises, naming the input, where Dynamo would have compiled another graph. A
  graph whose trace guarded its sizes in any other way (a relation between two sizes) is not
  called directly (`GraphSpec.describe` returns None).

`GraphRunner.guarded()` sends the steps through Dynamo again, so that recompile checks
(`fail_on_recompile`) see every step.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GraphInput:
    """One input of a compiled graph, as the graph was traced with it.

    kind "state": a weight or buffer of the model, `name` its qualified name;
    kind "step": a tensor of the step, `name` its name in the call (input_ids, keys, …);
    kind "size": a dynamic size, `name` its symbol.
    shape: the traced sizes, a symbol's name (str) for a dynamic one; stride: a state tensor's."""

    kind: str
    name: str
    shape: tuple = ()
    dtype: str = ""
    device: str = ""
    stride: tuple = ()


@dataclass(frozen=True)
class GraphSpec:
    """What a compiled graph takes, in order, and the range of each of its size symbols. Plain
    data, so that qrt's compile cache can store it beside the graph."""

    inputs: tuple[GraphInput, ...]
    ranges: dict

    @classmethod
    def describe(cls, compiled, step_tensors: dict[str, torch.Tensor], state_names: dict[int, str],
                 outputs: int) -> "GraphSpec | None":
        """The spec of a graph the backend compiled (`QrtBackend.last_compiled`), with its inputs
        sorted into the call's own tensors (`step_tensors`, by name: the very tensors of the
        traced call), the model's state (`state_names`: id of each weight or buffer -> its name)
        and size symbols. None where an input is none of these, a size is an expression rather
        than a symbol, the sizes were guarded beyond ranges, or the graph does not return the
        `outputs` tensors the traced function does: then the graph needs Dynamo."""
        if (compiled is None or compiled.symbol_ranges is None or compiled.outputs != outputs
                or len(compiled.traced) != len(compiled.inputs)):
            return None
        by_identity = {id(t): name for name, t in step_tensors.items()}
        inputs = []
        for value, traced in zip(compiled.inputs, compiled.traced):
            if isinstance(value, torch.SymInt):
                symbol = str(value.node.expr)
                if not symbol.isidentifier():
                    return None
                inputs.append(GraphInput("size", symbol))
                continue
            if not isinstance(value, torch.Tensor) or not isinstance(traced, torch.Tensor):
                return None
            shape = tuple(_size(size) for size in traced.shape)
            if any(size is None for size in shape):
                return None
            if id(value) in by_identity:
                inputs.append(GraphInput("step", by_identity[id(value)], shape, str(value.dtype), str(value.device)))
            elif id(value) in state_names:
                if any(isinstance(size, str) for size in shape):
                    return None
                inputs.append(GraphInput("state", state_names[id(value)], shape, str(value.dtype), str(value.device),
                                         tuple(value.stride())))
            else:
                return None
        if sorted(i.name for i in inputs if i.kind == "step") != sorted(step_tensors):
            return None
        symbols = {size for i in inputs for size in i.shape if isinstance(size, str)}
        symbols |= {i.name for i in inputs if i.kind == "size"}
        if not symbols <= set(compiled.symbol_ranges) or any(set(pair) <= symbols for pair in compiled.equal_symbols):
            return None  # a size without a range, or two sizes that must be equal (not checked here)
        return cls(tuple(inputs), {symbol: compiled.symbol_ranges[symbol] for symbol in sorted(symbols)})


def _size(size) -> int | str | None:
    """A traced size: an int, a symbol's name, or None for an expression of symbols."""
    if isinstance(size, torch.SymInt):
        text = str(size.node.expr)
        return text if text.isidentifier() else None
    return int(size)


class DirectGraph:
    """`fn(*inputs)` with the weights and caches filled in; call it with the step's tensors."""

    def __init__(self, fn, spec: GraphSpec, state: dict[str, torch.Tensor], role: str,
                 size_names: dict[tuple[str, int], str] | None = None):
        """state: the model's weights and buffers by name (those the spec names must be there and
        match it, else ValueError). size_names: words for a dynamic size in errors, by the
        (step tensor, dim) it appears in first."""
        self.fn = fn
        self.spec = spec
        self.role = role  # which step's graph, for errors
        self.template = []  # every graph input; the step's places are refilled on each call
        self.steps = []  # (position, GraphInput, its dtype and device) of the step's tensors
        self.sizes = []  # (position, symbol) of the dynamic sizes passed as inputs
        # Where each symbol is read from: the first (step tensor, dim) it appears in.
        self.symbol_source: dict[str, tuple[str, int]] = {}
        for position, graph_input in enumerate(spec.inputs):
            if graph_input.kind == "state":
                self.template.append(self._checked_state(graph_input, state))
                continue
            self.template.append(None)
            if graph_input.kind == "size":
                self.sizes.append((position, graph_input.name))
            else:
                self.steps.append((position, graph_input, getattr(torch, graph_input.dtype.removeprefix("torch.")),
                                   torch.device(graph_input.device)))
                for dim, size in enumerate(graph_input.shape):
                    if isinstance(size, str):
                        self.symbol_source.setdefault(size, (graph_input.name, dim))
        missing = {symbol for _, symbol in self.sizes} - set(self.symbol_source)
        if missing:
            raise ValueError(f"{role} graph: sizes {sorted(missing)} appear in none of its step tensors")
        names = size_names or {}
        self.size_words = {symbol: names.get(source, f"size of {source[0]!r} in dim {source[1]}")
                           for symbol, source in self.symbol_source.items()}

    def _checked_state(self, graph_input: GraphInput, state: dict[str, torch.Tensor]) -> torch.Tensor:
        tensor = state.get(graph_input.name)
        if tensor is None:
            raise ValueError(f"{self.role} graph: the model has no weight or buffer {graph_input.name!r}")
        got = (tuple(tensor.shape), str(tensor.dtype), str(tensor.device), tuple(tensor.stride()))
        want = (graph_input.shape, graph_input.dtype, graph_input.device, graph_input.stride)
        if got != want:
            raise ValueError(f"{self.role} graph: {graph_input.name!r} is {got[1]} {list(got[0])} strides "
                             f"{list(got[3])} on {got[2]}; the graph was compiled for {want[1]} {list(want[0])} "
                             f"strides {list(want[3])} on {want[2]}")
        return tensor

    def __call__(self, tensors: dict[str, torch.Tensor]):
        """The graph's outputs for this step's tensors (by name)."""
        values = {}
        for symbol, (name, dim) in self.symbol_source.items():
            value = tensors[name].shape[dim] if tensors[name].dim() > dim else -1
            low, high = self.spec.ranges[symbol]
            if not low <= value <= high:
                raise ValueError(f"{self.role} step: {self.size_words[symbol]} {value} is outside the range "
                                 f"[{low}, {high}] the {self.role} graph was compiled for")
            values[symbol] = value
        inputs = self.template.copy()
        for position, step, dtype, device in self.steps:
            tensor = tensors[step.name]
            want = [values[size] if isinstance(size, str) else size for size in step.shape]
            if tensor.dtype != dtype or tensor.device != device or list(tensor.shape) != want or not tensor.is_contiguous():
                raise ValueError(f"{self.role} step: input {step.name!r} is {tensor.dtype} {list(tensor.shape)} on "
                                 f"{tensor.device}; the {self.role} graph was compiled for {step.dtype} {want} on "
                                 f"{step.device}, contiguous")
            inputs[position] = tensor
        for position, symbol in self.sizes:
            inputs[position] = values[symbol]
        with torch.no_grad():
            return self.fn(*inputs)
