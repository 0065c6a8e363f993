"""A compiled graph called without Dynamo, for the decode step (and the speculative check).

Every call of a `torch.compile`d function goes through Dynamo first: its cache lookup evaluates a
guard on each of a few hundred weight and cache tensors, its bytecode gathers them from the
module tree again, and only then does the compiled graph run. On a one-token int4 decode step of
the default model that was 1.3 ms of 7.1 (`bench/profile_decode.py`, docs/cpu-kernels.md). qrt builds every
input of its decode graph itself, so it can hold the guarantees the guards gave instead:

- the weights and caches are the tensors Dynamo compiled the graph for: they are held here, and
  qrt never replaces them (weights are loaded once; the caches are written in place);
- the per-step tensors have the shapes and dtypes they had when the graph was traced, and the one
  dynamic size (the attended length) stays in the range it was traced for; `DirectGraph.__call__`
  checks both and raises, naming the input, where Dynamo would have compiled another graph.

`CompiledModel.guarded()` sends decode through Dynamo again, so that recompile checks
(`fail_on_recompile`) see every step.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepInput:
    """What one per-step tensor must look like: its position among the graph's inputs, and the
    shape (None: the dynamic dim), dtype and device it was traced with."""

    name: str
    position: int
    shape: tuple[int | None, ...]
    dtype: torch.dtype
    device: torch.device


class DirectGraph:
    """`compiled(*inputs)` with the weights and caches filled in; call it with the step's tensors."""

    def __init__(self, compiled, template: list, steps: list[StepInput], size_position: int | None,
                 size_range: tuple[int, int], role: str = "decode"):
        self.role = role  # which step's graph, for errors
        self.compiled = compiled
        self.template = template  # every graph input; the step's slots are refilled on each call
        self.steps = steps
        self.size_position = size_position  # where the dynamic size goes, if the graph takes one
        self.size_range = size_range

    @classmethod
    def capture(cls, compiled_and_inputs, step_tensors: dict[str, torch.Tensor], state: list[torch.Tensor],
                dynamic: tuple[str, int], size_range: tuple[int, int], role: str = "decode") -> "DirectGraph | None":
        """The graph a backend compiled (`QrtBackend.last_compiled`), with its inputs sorted into the
        step's own (`step_tensors`, by name, the very tensors of the traced call), the model's
        `state` (weights and buffers) and the dynamic size of `dynamic` = (tensor name, dim).
        None where some input is neither: then the graph needs Dynamo to gather its inputs."""
        if compiled_and_inputs is None:
            return None
        compiled, inputs = compiled_and_inputs
        by_identity = {id(t): name for name, t in step_tensors.items()}
        state_ids = {id(t) for t in state}
        template, steps, size_position = [], [], None
        for position, value in enumerate(inputs):
            if isinstance(value, torch.SymInt):
                if size_position is not None:  # a second dynamic size: not the graph traced here
                    return None
                size_position = position
            elif isinstance(value, torch.Tensor) and id(value) in by_identity:
                name = by_identity[id(value)]
                shape = tuple(None if (name, dim) == dynamic else int(size) for dim, size in enumerate(value.shape))
                steps.append(StepInput(name, position, shape, value.dtype, value.device))
            elif not (isinstance(value, torch.Tensor) and id(value) in state_ids):
                return None
            template.append(value)
        if sorted(s.name for s in steps) != sorted(step_tensors):
            return None
        return cls(compiled, template, steps, size_position, size_range, role)

    def __call__(self, tensors: dict[str, torch.Tensor], size: int):
        """The graph's outputs for this step's tensors (by name) and dynamic size."""
        low, high = self.size_range
        if not low <= size <= high:
            raise ValueError(f"{self.role} step: attended length {size} is outside the range [{low}, {high}] the "
                             f"{self.role} graph was compiled for")
        inputs = self.template.copy()
        for step in self.steps:
            tensor = tensors[step.name]
            if (tensor.dtype != step.dtype or tensor.device != step.device or tensor.dim() != len(step.shape)
                    or any(got != (size if want is None else want) for got, want in zip(tensor.shape, step.shape))):
                raise ValueError(f"{self.role} step: input {step.name!r} is {tensor.dtype} {list(tensor.shape)} on "
                                 f"{tensor.device}; the {self.role} graph was compiled for {step.dtype} "
                                 f"{[size if s is None else s for s in step.shape]} on {step.device}")
            inputs[step.position] = tensor
        if self.size_position is not None:
            inputs[self.size_position] = size
        with torch.no_grad():
            return self.compiled(*inputs)
