"""Weight layouts, declared by the kernels that read them (`Kernel.layout`).

A layout is the one place that knows both halves of a kernel's contract with a layer: how the
loader pass turns the layer's weights into the tensors the kernel takes (`pack`), and how the
layer then calls it (`linear`). A format describes its weights in the neutral form of the logical
op it computes (`IntWeights` for `qrt::int_linear`, `Fp8Weights` for the fp8 ops, ...), asks
`choose()` for the device's kernel, and hands the weights to that kernel's layout. It never asks
which layout it got, so a kernel with a layout of its own is one new kernel file.

Layouts are stateless singletons: the compiled graph bakes the Python branch `linear` takes, and a
layer records the layout it was packed for (`LinearMethod.layout`), whose `name` shows in
`inspect` and keys which experts may share a fused kernel.

Two conventions the passes rely on: the packed tensor that carries the kernel's record is the
layer's parameter `weight` (`install_packed` records `kernel` and `storage_layout` on it), and the
op `linear` calls takes it as its second argument, after the activations: the swap pass reads the
record from there (passes/swap_linear.py).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Packed:
    """What a layout's `pack` made for one layer."""

    # The layer's tensors by parameter name ("weight" holds the kernel's weight); None registers
    # the name as absent (e.g. no act-order permutation), so `linear` can read it either way.
    tensors: dict[str, torch.Tensor | None]
    storage: str  # how the weight is stored now, as `inspect` and `dump` show it
    # Attributes recorded on the weight besides its kernel and storage (packed_dim, group_size, ...)
    weight_attributes: dict = field(default_factory=dict)
    # Plain values the layer keeps for `linear` (e.g. the int4 CPU kernel's group size)
    constants: dict = field(default_factory=dict)
    # The tensors a kernel call takes as its weight, on which the kernel is recorded: more than
    # `weight` where a layer runs in parts along N, each its own call.
    kernel_tensors: tuple[str, ...] = ("weight",)


class Layout(ABC):
    """How one kernel takes a layer's weights. Subclasses set `name` and implement both halves."""

    name: str

    @abstractmethod
    def pack(self, weights, dtype: torch.dtype) -> Packed:
        """The kernel's tensors for `weights` (the logical op's neutral form) in a model of `dtype`,
        on the device the weights were loaded to."""

    @abstractmethod
    def linear(self, layer, x: torch.Tensor, *settings) -> torch.Tensor:
        """x [..., K] -> [..., N] with the tensors `pack` made, which the layer now holds;
        `settings` are the logical op's plain arguments (bits and group size, for example)."""

    # Whether `rows` can read single rows of the weight back: an embedding that holds the same
    # values as this layer (a GGUF's tied output layer) then looks its rows up here, not in a copy.
    gathers_rows = False

    def rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([...] int64, < N) of the weight `pack` made, as values [..., K] in the
        model dtype."""
        raise NotImplementedError(f"the {self.name!r} layout does not gather rows")

    def __repr__(self) -> str:
        return f"<layout {self.name}>"


class NamedLayout(Layout):
    """A layout no loader pass packs through this interface: a compiled CPU model's repacked
    weights (made after the loader pass, layers/prepack.py), or a kernel that runs no layer's
    linear weights (attention over a KV cache, the experts' dispatch). A name for `inspect`."""

    def __init__(self, name: str):
        self.name = name

    def pack(self, weights, dtype):
        raise TypeError(f"the {self.name!r} layout holds no linear weights")

    def linear(self, layer, x, *settings):
        raise TypeError(f"the {self.name!r} layout holds no linear weights")
