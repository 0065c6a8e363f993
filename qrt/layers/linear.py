"""The quantized-linear contract: what a model builds, what a format implements, what the loader
streams into. Models and formats import this module and nothing else of the loaders' internals.

- `Linear`: y = x Wᵀ (+ b), whose weights a `LinearMethod` creates, loads, repacks and runs.
- `LinearMethod`: the four hooks every format implements (docs/architecture.md, "how to add a
  format").
- Parameters are plain `nn.Parameter`s carrying an attribute dict (`make_parameter`): Parameter
  subclasses break `torch.compile` (Dynamo cannot trace them, which is why other runtimes convert
  theirs back to plain Parameters before compiling), so loader metadata lives as ordinary
  attributes, read at load time and by the passes, never in `forward`.
- `ShardLayout`: where each shard of a fused layer (q/k/v, gate/up) lands.
- Tensor parallelism (tensor_parallel.py): a `Linear` built with its rank's part of an axis, and
  each format's `shard_rule`, how its checkpoint tensors divide between ranks.
- `CheckpointNames`: how a model maps checkpoint tensor names to its parameters.
- FP8 KV-cache scales, the one quantized tensor that belongs to attention rather than a linear.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from qrt.kernels.fp8_reference import FP8_DTYPE, FP8_MAX
from qrt.kernels.layouts import Packed

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.layers.tensor_parallel import (OUTPUT_VECTOR, SINGLE, Parallelism, RankSlice, TensorSplit, all_gather_last,
                                        all_reduce)

# Attribute names a parameter may carry. Keeping them in one place catches typos at creation.
KNOWN_ATTRIBUTES = frozenset(
    {
        "weight_loader",  # callable(param, loaded_tensor, shard_id) that writes into param
        "input_dim",  # dim of the param that runs along the layer's input features (K)
        "output_dim",  # dim that runs along the output features (N)
        "packed_dim",  # dim holding packed sub-byte values, if any
        "packed_factor",  # values per stored element along packed_dim
        "group_size",  # input channels per quantization group of a grouped layout
        "quant_format",  # e.g. "fp8", "bf16"
        "storage_layout",  # storage layout after the loader pass, e.g. "fp8_e4m3 [N, K]"
        "kernel",  # the kernel op the layout was made for (qrt.kernels.choices), set by the loader pass
        "experts_kernel",  # stacked experts (experts.py): the op that runs them all, for the swap pass
        "optional",  # loaded when the checkpoint has it; the format's loader pass decides if it must
        "loaded_shape",  # shape of the tensor the weight_loader takes, when not the parameter's own
    }
)


def make_parameter(data: torch.Tensor, **attributes) -> nn.Parameter:
    """A frozen plain Parameter with the given attributes set on it."""
    unknown = set(attributes) - KNOWN_ATTRIBUTES
    if unknown:
        raise TypeError(f"unknown parameter attribute(s): {sorted(unknown)}")
    param = nn.Parameter(data, requires_grad=False)
    for name, value in attributes.items():
        setattr(param, name, value)
    return param


def attributes_of(param: nn.Parameter) -> dict:
    """The qrt attributes a parameter carries (for inspect and dump)."""
    return {name: getattr(param, name) for name in KNOWN_ATTRIBUTES if hasattr(param, name)}


def replace_parameter(module: nn.Module, name: str, data: torch.Tensor, **attributes) -> nn.Parameter:
    """Swap `module.<name>` for a new plain Parameter holding `data`, keeping its attributes.

    Used by the loader pass when a layout changes dtype or shape, which an in-place copy cannot.
    """
    kept = attributes_of(getattr(module, name))
    kept.update(attributes)
    new = make_parameter(data, **kept)
    setattr(module, name, new)
    return new


def install_packed(layer: nn.Module, packed: Packed, kernel: str, quant_format: str | None = None,
                   note: str | None = None) -> None:
    """Give `layer` the tensors a kernel's layout packed (kernels/layouts.py) and record the kernel
    and storage on its weight (`note`: what the format adds to the storage's description). A
    tensor replacing a parameter keeps that parameter's attributes; a new one starts bare; None
    registers the name as absent."""
    for name, tensor in packed.tensors.items():
        attributes = {}
        if name in packed.kernel_tensors:
            storage = packed.storage if note is None else f"{packed.storage}, {note}"
            attributes = dict(packed.weight_attributes, kernel=kernel, storage_layout=storage)
            if quant_format is not None:
                attributes["quant_format"] = quant_format
        if tensor is None:
            layer.register_parameter(name, None)
        elif getattr(layer, name, None) is not None:
            replace_parameter(layer, name, tensor, **attributes)
        else:
            setattr(layer, name, make_parameter(tensor, **attributes))
    for name, value in packed.constants.items():
        setattr(layer, name, value)


@dataclass(frozen=True)
class ShardLayout:
    """Output rows of each shard of a fused layer: shard id -> (offset, size).

    A fused layer stacks its shards along the output dim; the checkpoint stores each shard as its
    own tensor, so each arrives with a shard id and is written into its rows."""

    offsets: dict

    @classmethod
    def stacked(cls, shard_ids, sizes) -> "ShardLayout":
        offsets, start = {}, 0
        for shard_id, size in zip(shard_ids, sizes, strict=True):
            offsets[shard_id] = (start, size)
            start += size
        return cls(offsets)

    @property
    def shard_ids(self) -> tuple:
        return tuple(self.offsets)

    @property
    def sizes(self) -> list[int]:
        return [size for _, size in self.offsets.values()]

    def rows(self, tensor: torch.Tensor, shard_id, dim: int = 0) -> torch.Tensor:
        """The view of `tensor` holding shard `shard_id` (the whole tensor for shard None)."""
        if shard_id is None:
            return tensor
        if shard_id not in self.offsets:
            raise TensorMismatch(f"unknown shard {shard_id!r}; this layer has {list(self.offsets)}")
        start, size = self.offsets[shard_id]
        return tensor.narrow(dim, start, size)


def check_shape(loaded: torch.Tensor, expected, what: str = "tensor") -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise TensorMismatch(f"{what} has shape {list(loaded.shape)}, expected {list(expected)}")


def copy_rows(param, loaded: torch.Tensor, shard_id, *, layout: ShardLayout | None) -> None:
    """weight_loader for plain tensors: copy (with dtype conversion) into the shard's rows."""
    dst = param.data if layout is None else layout.rows(param.data, shard_id, param.output_dim)
    check_shape(loaded, dst.shape)
    # Any float width converts, but a 1-byte float (fp8) into a wider parameter means the
    # checkpoint is quantized where qrt expects plain weights: its scale would be lost.
    if not loaded.dtype.is_floating_point or (loaded.dtype.itemsize == 1 < dst.dtype.itemsize):
        raise TensorMismatch(f"dtype {loaded.dtype}, expected {dst.dtype} (or another 2- or 4-byte float)")
    dst.copy_(loaded)


class LinearMethod(ABC):
    """How one quantization format creates, loads, repacks and runs a `Linear`'s weights.

    A format registers its methods in the format registry (registry.py); the model asks its
    QuantScheme for the method of each layer by checkpoint module names."""

    name: str  # the format as `inspect` shows it
    # The layer's weight is the plain [N, K] tensor in the model dtype, so a tied lm_head may share
    # the embedding's parameter.
    stores_dense_weight = False
    # Tensor parallelism (tensor_parallel.py): parameter name -> TensorSplit of the checkpoint tensor
    # it loads, how that tensor follows the layer's output and input axes. None: not declared, and a
    # sharded load refuses the format.
    shard_rule: dict | None = None
    # Checkpoint tensors named with more dots than a parameter name may hold (bitsandbytes'
    # `q_proj.weight.absmax`): the name after the layer's -> the parameter it loads into.
    checkpoint_leaves: dict = {}

    def __init__(self, cfg=None, module_names=()):
        self.cfg = cfg  # the format's settings for this layer (a frozen dataclass), if it has any
        self.module_names = list(module_names)  # the checkpoint modules of the layer (a fused layer's shards)
        self.layout = None  # the layout (kernels/layouts.py) the loader pass packed the weights for

    def tensor_split(self, layer: "Linear", param_name: str) -> "TensorSplit | None":
        """The TensorSplit of the checkpoint tensor that loads into `param_name`: `shard_rule`'s
        entry; a format whose rule depends on the layer overrides this."""
        if self.shard_rule is None:
            return None
        return self.shard_rule.get(param_name)

    @abstractmethod
    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        """Register the parameters the checkpoint's tensors load into (on the meta device), each
        with a weight_loader. The bias, if any, is the Linear's own."""

    @abstractmethod
    def process_after_loading(self, layer: "Linear", device: torch.device) -> None:
        """The loader pass: repack the loaded tensors into the layout of the kernel chosen for
        `device` (qrt.kernels.choices) and record it on the weight (`kernel`, `storage_layout`)."""

    @abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """forward: x [..., K] -> [..., N], through the logical op (or the opaque-layout kernel op)
        of the layout the loader pass made."""


class Linear(nn.Module):
    """y = x Wᵀ (+ b) whose weights are created, loaded and run by a LinearMethod.

    output_sizes has one entry per shard of a fused layer (q/k/v, gate/up) with matching
    shard_ids; the checkpoint's per-shard tensors are loaded into their rows. The bias is kept in
    the model dtype in every format.

    Tensor parallelism (tensor_parallel.py): `n_slices` (one RankSlice per output size) or `k_slice`
    give this rank's part of the output rows (column-parallel) or of the input channels
    (row-parallel); the layer is built with its rank's sizes and loads its rank's slice of each
    tensor. A row-parallel layer sums its partial outputs over the ranks (its bias loaded on rank 0
    only, so that it is added once); with `gather_output` the ranks' output rows are concatenated
    (the vocabulary of lm_head) and cut back to the full size.
    """

    def __init__(self, input_size: int, output_sizes, *, bias: bool, method: LinearMethod, dtype, shard_ids=None,
                 parallel: Parallelism = SINGLE, n_slices=None, k_slice: RankSlice | None = None,
                 gather_output: bool = False):
        super().__init__()
        self.parallel = parallel
        self.n_slices = None if n_slices is None or all(s.whole for s in n_slices) else tuple(n_slices)
        self.k_slice = None if k_slice is None or k_slice.whole else k_slice
        if self.n_slices is not None:
            output_sizes = [s.length for s in self.n_slices]
        full_input_size = input_size
        if self.k_slice is not None:
            input_size = self.k_slice.length
        self.full_output_size = sum(s.full for s in n_slices) if n_slices is not None else sum(output_sizes)
        self.full_input_size = full_input_size  # K of the whole layer (the checkpoint's), before a row-parallel split
        self.full_shard_sizes = [s.full for s in n_slices] if n_slices is not None else list(output_sizes)
        self.input_size = input_size  # this rank's sizes, which the format's tensors are created for
        self.output_size = sum(output_sizes)
        self.has_bias = bias
        self.params_dtype = dtype
        self.shard_layout = None if shard_ids is None else ShardLayout.stacked(shard_ids, output_sizes)
        self.quant_method = method
        self.gather_output = gather_output and parallel.sharded
        self.register_parameter("bias", None)
        # The resident LoRA adapters' pairs (lora.py), attached after loading where a model serves
        # adapters; None otherwise, and then forward is the base's alone.
        self.lora = None
        if bias:
            load_bias = partial(copy_rows, layout=self.shard_layout)
            if self.splits_input and parallel.rank != 0:
                load_bias = _zeros_instead
            self.bias = make_parameter(
                torch.empty(self.output_size, dtype=dtype),  # [N]
                weight_loader=load_bias, output_dim=0, quant_format=method.name,
            )
        try:
            method.create_weights(self, dtype)
        except UnsupportedError as err:
            if not parallel.sharded:
                raise
            raise UnsupportedError(f"{err} (with tp={parallel.size}: the sizes are one rank's part of the "
                                   f"layer)") from None

    @property
    def splits_input(self) -> bool:
        """Row-parallel: the output is a partial sum. Tensors that run along K in the checkpoint
        but must stay whole on every rank (act-order group scales) are sized by full_input_size."""
        return self.k_slice is not None

    def tensor_split(self, param_name: str) -> TensorSplit | None:
        """How the checkpoint tensor of `param_name` divides between ranks (read by the loader)."""
        if param_name == "bias":
            return OUTPUT_VECTOR  # the Linear's own, in every format
        return self.quant_method.tensor_split(self, param_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if self.lora is not None:  # before the all-reduce: a row-parallel delta is a partial sum too
            y = self.lora(y, x)
        if self.splits_input:
            y = all_reduce(y, self.parallel)
        if self.gather_output:
            y = all_gather_last(y, self.parallel)[..., : self.full_output_size]
        return y

    def extra_repr(self) -> str:
        shard = ""
        if self.n_slices is not None:
            shard = f", column-parallel {self.parallel.rank}/{self.parallel.size}"
        elif self.k_slice is not None:
            shard = f", row-parallel {self.parallel.rank}/{self.parallel.size}"
        return f"in={self.input_size}, out={self.output_size}, bias={self.has_bias}, quant={self.quant_method.name}{shard}"


def _zeros_instead(param, loaded, shard_id):
    """A row-parallel bias on ranks other than 0: the sum over ranks adds rank 0's once."""
    param.data.zero_()


@dataclass(frozen=True)
class CheckpointNames:
    """How a model's checkpoint tensor names map to its parameters.

    stacked: (fused parameter infix, checkpoint shard infix, shard id), e.g. (".qkv_proj.",
      ".q_proj.", "q"): checkpoints store q/k/v and gate/up apart, qrt runs each group as one matmul;
    renamed: (checkpoint suffix, parameter suffix) for tensors other exporters name otherwise;
    ignored_suffixes: checkpoint tensors that carry nothing qrt needs (derived buffers);
    ignored_prefixes: modules of the checkpoint qrt does not run (DeepSeek-V3's multi-token prediction);
    tied: checkpoint tensors that alias another one in this model and are skipped;
    copies: parameter -> other parameters loaded from the same checkpoint tensor (a tied lm_head
      quantized online has a weight of its own, quantized from the embeddings as they stream in);
    moved: (checkpoint prefix, parameter prefix), the first that matches applying before the rest:
      modules the model holds elsewhere than the checkpoint's name says (DeepSeek-V3's
      multi-token-prediction layer, stored as one more decoder layer).
    """

    stacked: tuple = ()
    renamed: tuple = ()
    ignored_suffixes: tuple = ()
    ignored_prefixes: tuple = ()
    tied: tuple = ()
    copies: dict = field(default_factory=dict)
    moved: tuple = ()

    def parameter_of(self, name: str) -> tuple[str, object]:
        """(parameter name, shard id or None) that checkpoint tensor `name` loads into."""
        for stored, held in self.moved:
            if name.startswith(stored):
                name = held + name[len(stored):]
                break
        for old, new in self.renamed:
            if name.endswith(old):
                return name[: -len(old)] + new, None
        for fused, shard, shard_id in self.stacked:
            if shard in name:
                return name.replace(shard, fused), shard_id
        return name, None

    def skipped(self, name: str) -> bool:
        return name in self.tied or name.endswith(self.ignored_suffixes) or name.startswith(self.ignored_prefixes)


# Checkpoint names of FP8 KV-cache scales -> the attention-level names qrt loads them under.
KV_SCALE_RENAMES = (
    (".k_proj.k_scale", ".k_scale"),  # ModelOpt export
    (".v_proj.v_scale", ".v_scale"),
    (".k_proj.output_scale", ".k_scale"),  # older compressed-tensors exports
    (".v_proj.output_scale", ".v_scale"),
)


def _load_kv_scale(param, loaded, shard_id):
    # Used as stored: ModelOpt's Hugging Face export (0.47) writes amax / 448 unclamped (its
    # TensorRT-LLM and Megatron exports floor it at 1.0, which this file format does not record),
    # and quantize_kv saturates at +-448 anyway.
    if loaded.numel() != 1 or not loaded.dtype.is_floating_point:
        raise TensorMismatch(f"shape {list(loaded.shape)} {loaded.dtype}, expected one float KV-cache scale")
    value = float(loaded.reshape(()))
    if not value > 0 or value == float("inf"):
        raise TensorMismatch(f"KV-cache scale {value}; a scale must be a positive finite multiplier")
    param.data.fill_(value)


def create_kv_scales(attention: nn.Module) -> None:
    """k_scale and v_scale of an FP8 KV cache: the cache holds k / k_scale cast to e4m3 and is
    read back as k_fp8 * k_scale (same for v)."""
    for name in ("k_scale", "v_scale"):
        setattr(attention, name, make_parameter(
            torch.empty(1),  # [1] fp32
            weight_loader=_load_kv_scale, quant_format="fp8 kv cache",
        ))


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B, KVH, T, hd] activations -> e4m3 codes to store in the cache."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (cache.float() * scale).to(dtype)
