"""LoRA adapters served beside a loaded model: which layers hold adapter slots, which adapter each
slot holds, and which adapter each batch row of a step uses.

`LoraSet.attach` gives every adaptable `Linear` of the model's decoder layers whose module kind an
adapter may target a `LoraWeights` (layers/lora.py) with `max_loras` slots of rank
`max_lora_rank`, before the graphs are compiled. Adapters are then loaded into free slots and
dropped from them at any time, in place, so the graphs never change. A request names its adapter;
the engine binds it to the request's KV-cache slot (`bind`), and before each graph call the runner
writes the adapter slot of each batch row into the shared row table (`route`).

An adapter's module names are the base model's as transformers names them (PEFT's files), and go
to qrt's layers through the model's checkpoint names: `q_proj` of a layer lands in the q shard of
that layer's fused `qkv_proj`. Every layer of a kind carries slots, so the layers stay alike and
each distinct layer still compiles once; an adapter that leaves a layer out leaves zeros there.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qrt.checkpoint.hub import locate_adapter
from qrt.checkpoint.lora_adapter import LoraAdapter, read_adapter
from qrt.errors import UnsupportedError
from qrt.layers.linear import Linear
from qrt.layers.lora import LoraWeights

DEFAULT_MAX_LORA_RANK = 16
# What a model adapts where no adapter given at start names its targets: the dense attention and
# MLP projections, which is what PEFT's LoRA configs target nearly always.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules a LoRA row cannot follow: MoE experts and routers run on tokens flattened across rows.
_NOT_ADAPTABLE = re.compile(r"\.(experts|shared_experts?|gate)(\.|$)")
# The graph roles whose rows are the KV-cache slots themselves; the others feed one slot
# (`slots` input) or none (forward, encode: no adapter).
_ROWS_ARE_SLOTS = ("decode", "verify")


class UnknownAdapter(KeyError):
    """A request named an adapter that is not loaded (the server answers 404)."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(name)
        self.name, self.known = name, known

    def __str__(self) -> str:
        return f"no LoRA adapter named {self.name!r} is loaded; loaded: {self.known or 'none'}"


class NoFreeSlot(ValueError):
    """Every adapter slot holds an adapter (or one unloaded whose requests still run)."""


@dataclass(frozen=True)
class Resident:
    """An adapter in a slot. `identity` is new on every load, so that KV-cache prefixes computed
    with an adapter are never reused under another one loaded later under the same name. Its slot
    stays taken while a KV-cache slot's request runs with it (`LoraSet.kv_slots`), unloaded or not."""

    name: str
    path: Path
    slot: int
    identity: int
    rank: int


@dataclass
class LoraSet:
    model: object
    max_loras: int
    max_rank: int
    rows: torch.Tensor  # [R] int64: the adapter slot of each batch row of the running step
    layers: dict  # qrt module name -> (Linear, leaf names of its shards)
    residents: dict = field(default_factory=dict)  # name -> Resident
    kv_slots: list = field(default_factory=list)  # KV-cache slot -> its request's Resident, or None
    _identities: int = 0
    _written: tuple = ()

    @classmethod
    def attach(cls, model, max_loras: int, max_rank: int, targets) -> "LoraSet":
        """Give the model's adaptable layers whose leaf name is in `targets` (names as
        transformers' modules have them, e.g. "q_proj"; "all-linear": every adaptable one)
        `max_loras` adapter slots of rank `max_rank`."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} and {max_rank}")
        device = model.model.norm.weight.device
        rows = torch.zeros(max(model.max_batch_size, 1), dtype=torch.long, device=device)  # [R]
        adaptable = _adaptable_layers(model)
        wanted = set(adaptable_leaves(adaptable)) if targets == "all-linear" else set(targets)
        unknown = wanted - set(adaptable_leaves(adaptable))
        if unknown:
            raise ValueError(f"LoRA target modules {sorted(unknown)} are not adaptable layers of "
                             f"{type(model).__name__}; it has {sorted(set(adaptable_leaves(adaptable)))}")
        layers = {}
        for name, (linear, leaves) in adaptable.items():
            if wanted & set(leaves):
                sizes = linear.shard_layout.sizes if linear.shard_layout is not None else [linear.output_size]
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                linear.lora = LoraWeights(max_loras, max_rank, list(zip(starts, sizes)), linear.input_size, rows,
                                          model.dtype, device)
                layers[name] = (linear, leaves)
        if not layers:
            raise ValueError(f"no layer of {type(model).__name__} matches the LoRA targets {sorted(wanted)}")
        return cls(model, max_loras, max_rank, rows, layers, kv_slots=[None] * model.max_batch_size)

    @property
    def targets(self) -> list[str]:
        """The leaf names of the layers that hold adapter slots."""
        return sorted({leaf for _, leaves in self.layers.values() for leaf in leaves})

    def describe(self) -> dict:
        """What the compiled graphs depend on (the compile cache's key)."""
        return {"slots": self.max_loras, "rank": self.max_rank, "layers": sorted(self.layers)}

    # ---- adapters ------------------------------------------------------------------------------
    def load(self, name: str, path, progress: bool = False) -> Resident:
        """Read the adapter at `path` (a folder or a hub id) into a free slot under `name`."""
        return self.add(name, read_adapter(locate_adapter(path, progress=progress)))

    def add(self, name: str, adapter: LoraAdapter) -> Resident:
        """Put an adapter already read into a free slot under `name`."""
        check_name(name)
        if name in self.residents:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already; unload it first")
        placed = self._place(adapter)  # checks everything before a slot is touched
        taken = {r.slot for r in self.residents.values()} | {r.slot for r in self.kv_slots if r is not None}
        free = [s for s in range(1, self.max_loras + 1) if s not in taken]
        if not free:
            raise NoFreeSlot(f"all {self.max_loras} LoRA adapter slots are in use ({', '.join(sorted(self.residents))}); "
                             f"unload one or raise max_loras")
        slot = free[0]
        for lora in (linear.lora for linear, _ in self.layers.values()):
            lora.clear(slot)
        for lora, shard, a, b in placed:
            lora.write(slot, shard, a, b)
        self._identities += 1
        resident = Resident(name, adapter.path, slot, self._identities, adapter.rank)
        self.residents[name] = resident
        return resident

    def unload(self, name: str) -> None:
        """Drop adapter `name`: new requests can no longer name it; requests running with it
        finish with it, and its slot frees after the last."""
        if self.residents.pop(name, None) is None:
            raise UnknownAdapter(name, sorted(self.residents))

    def _place(self, adapter: LoraAdapter) -> list:
        """(LoraWeights, shard index, A, B·scaling) of each of the adapter's modules, cut to this
        rank's part; errors name the module and what was expected."""
        where = adapter.path
        if adapter.rank > self.max_rank:
            raise ValueError(f"{where}: the adapter's rank {adapter.rank} exceeds max_lora_rank={self.max_rank}")
        names = self.model.checkpoint_names()
        placed = []
        for module, pair in adapter.modules.items():
            param, shard_id = names.parameter_of(f"{module}.weight")
            layer_name = param.removesuffix(".weight")
            entry = self.layers.get(layer_name)
            if entry is None:
                raise ValueError(f"{where}: the adapter targets {module!r}, which is not one of the layers this "
                                 f"model holds LoRA slots for ({', '.join(self.targets)} of its decoder layers)")
            linear = entry[0]
            shard = 0 if linear.shard_layout is None else linear.shard_layout.shard_ids.index(shard_id)
            full_rows, full_inputs = linear.full_shard_sizes[shard], linear.full_input_size
            if tuple(pair.a.shape[1:]) != (full_inputs,) or pair.b.shape[0] != full_rows:
                raise ValueError(f"{where}: {module}: lora_A {list(pair.a.shape)} and lora_B {list(pair.b.shape)} "
                                 f"do not fit the base layer ({full_rows} outputs, {full_inputs} inputs)")
            a, b = pair.a, pair.b * pair.scaling
            if linear.k_slice is not None:  # row-parallel: this rank's input channels
                a = a[:, linear.k_slice.start:linear.k_slice.start + linear.k_slice.length]
            if linear.n_slices is not None:  # column-parallel: this rank's output rows of the shard
                part = linear.n_slices[shard]
                b = b[part.start:part.start + part.length]
            placed.append((linear.lora, shard, a, b))
        return placed

    # ---- requests --------------------------------------------------------------------------------
    def resident(self, name: str | None) -> Resident | None:
        """The loaded adapter a new request names (None: the base alone)."""
        if name is None:
            return None
        if name not in self.residents:
            raise UnknownAdapter(name, sorted(self.residents))
        return self.residents[name]

    def bind(self, kv_slot: int, resident: Resident | None) -> None:
        """The request in KV-cache slot `kv_slot` runs with `resident` (None: no adapter, or the
        slot's request ended)."""
        self.kv_slots[kv_slot] = resident

    def route(self, role: str, inputs: dict) -> None:
        """Write the adapter slot of each batch row of `role`'s graph call (inputs by name)
        into the row table, where it changed."""
        if role in _ROWS_ARE_SLOTS:
            wanted = tuple(0 if r is None else r.slot for r in self.kv_slots)
        elif "slots" in inputs:
            resident = self.kv_slots[int(inputs["slots"].reshape(-1)[0])]
            wanted = (0 if resident is None else resident.slot,)
        else:
            wanted = ()
        wanted = wanted + (0,) * (len(self.rows) - len(wanted))
        if wanted != self._written:
            self.rows.copy_(torch.tensor(wanted, dtype=torch.long))
            self._written = wanted


def check_name(name) -> None:
    if not isinstance(name, str) or not name or name != name.strip() or "=" in name:
        raise ValueError(f"LoRA adapter name {name!r}: give a non-empty name without spaces around it or '='")


def lora_adapters(lora: dict | None, progress: bool) -> dict:
    """{name: LoraAdapter} of compile_model's `lora` ({name: folder or hub id}), read."""
    if lora is None:
        return {}
    if not isinstance(lora, dict):
        raise ValueError(f"lora= takes {{name: adapter folder or hub id}}, got {type(lora).__name__}")
    for name in lora:
        check_name(name)
    return {name: read_adapter(locate_adapter(path, progress=progress)) for name, path in lora.items()}


def targets_of(adapters, model) -> list[str]:
    """The leaf names that need adapter slots: those the adapters (LoraAdapters) adapt, or with
    none, the default projections the model has."""
    wanted = set()
    for adapter in adapters:
        wanted |= leaves_of(adapter)
    if wanted:
        return sorted(wanted)
    present = set(adaptable_leaves(_adaptable_layers(model)))
    return [leaf for leaf in DEFAULT_TARGETS if leaf in present] or "all-linear"


def _adaptable_layers(model) -> dict:
    """qrt module name -> (Linear, the transformers leaf names of its shards) for every Linear
    of the decoder layers a LoRA row can follow."""
    names = model.checkpoint_names()
    found = {}
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        if not isinstance(module, Linear) or _NOT_ADAPTABLE.search(name):
            continue
        if module.shard_layout is None:
            leaves = (name.rsplit(".", 1)[-1],)
        else:
            dotted = f"{name}."
            by_id = {shard_id: shard.strip(".") for fused, shard, shard_id in names.stacked if fused in dotted}
            if set(by_id) != set(module.shard_layout.shard_ids):
                continue  # a fused layer whose shards no checkpoint names apart
            leaves = tuple(by_id[shard_id] for shard_id in module.shard_layout.shard_ids)
        found[name] = (module, leaves)
    return found


def adaptable_leaves(adaptable: dict) -> list[str]:
    return sorted({leaf for _, leaves in adaptable.values() for leaf in leaves})


def leaves_of(adapter: LoraAdapter) -> set[str]:
    """The module leaf names an adapter targets (q_proj, down_proj, ...)."""
    return {module.rsplit(".", 1)[-1] for module in adapter.modules}


def check_unsupported_build(build: str) -> None:
    if build != "regional":
        raise UnsupportedError("LoRA adapters need build='regional': the frozen build folds every buffer into "
                               "its graph as a constant, so adapters could not change after compiling")
