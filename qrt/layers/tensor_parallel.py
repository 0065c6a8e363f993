"""Tensor parallelism's part of the quantized-linear contract: which part of each axis a rank
holds, how a checkpoint tensor divides between ranks, and the collectives a sharded layer calls.

The layout is Megatron's, which vLLM, SGLang and gpt-fast also use: q/k/v and gate/up split their
output features between ranks (column-parallel), o_proj and down_proj their input features
(row-parallel), so each block needs one all-reduce after attention and one after the MLP. The
embedding and lm_head split the vocabulary.

Shapes of a sharded model are this rank's: a `Linear` is built with its rank's sizes, every format
creates its parameters as it would for a smaller layer, and the loader hands each weight_loader the
rank's slice of the checkpoint tensor (cut by the format's `TensorSplit`s: `axis_cut`, called by the loader's `rank_cuts`). A
format therefore shards without sharding code of its own, except where a tensor does not follow its
layer's axes (act-order group scales, which every rank needs whole).

The collectives are torch's functional collectives: Dynamo traces them into the one compiled
graph, where Inductor schedules them like any other op (no graph break at a communication). An
all-reduce among CPU ranks of one host is qrt's own op instead, qrt_cpu::shm_all_reduce (through
a shared-memory segment; runtime/shm_all_reduce.py), which traces the same way: a functional op
with a fake.
"""

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as collectives

from qrt.errors import UnsupportedError

# A split vocabulary is padded so that each rank holds a multiple of this many rows: packed and
# grouped lm_head layouts then split on whole words and groups.
VOCAB_PAD = 64


@dataclass(frozen=True)
class Parallelism:
    """The tensor-parallel group a model is built for: `size` ranks, this process being `rank`.

    size 1 is a model that is not sharded; `group` is the torch.distributed process group (None
    when size is 1). `shm_handle`: the group's shared-memory segment in this process, which its
    all-reduces go through when every rank is on this host's CPU (None: through the group)."""

    size: int = 1
    rank: int = 0
    group: object = None
    shm_handle: int | None = None

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @property
    def all_reduce_path(self) -> str:
        """What an all-reduce of bf16 or fp32 goes through: "shm" or the group's backend ("gloo", "nccl")."""
        return "shm" if self.shm_handle is not None else dist.get_backend(self.group)

    def even(self, full: int, what: str) -> "RankSlice":
        """`full` entries split into `size` equal parts."""
        if full % self.size:
            raise UnsupportedError(f"{what}: {full} cannot be split between {self.size} ranks; the largest tp "
                                   f"that works is {largest_tp(full, 1, self.size)}")
        return RankSlice(full, self.size, self.rank)

    def heads(self, heads: int, head_dim: int, what: str, replicate: bool) -> "RankSlice":
        """`heads` attention heads of `head_dim`: split between ranks, or, with `replicate`, each
        head held by size / heads ranks when there are fewer heads than ranks (KV heads)."""
        if heads % self.size == 0:
            return RankSlice(heads * head_dim, self.size, self.rank)
        if replicate and self.size % heads == 0:
            return RankSlice(heads * head_dim, heads, self.rank // (self.size // heads))
        rule = (f"{heads} heads split between {self.size} ranks, or replicated when the ranks are a multiple "
                f"of the heads" if replicate else f"{heads} heads split evenly between {self.size} ranks")
        allowed = [t for t in range(self.size, 0, -1) if heads % t == 0 or (replicate and t % heads == 0)]
        divisors = ", ".join(str(t) for t in range(1, heads + 1) if heads % t == 0)
        raise UnsupportedError(f"{what}: cannot shard {rule}; the largest tp that works is {allowed[0]} "
                               f"(tp values that split {heads} heads: {divisors})")

    def vocab(self, full: int) -> "RankSlice":
        """A vocabulary split between ranks, padded to whole parts of VOCAB_PAD rows."""
        if self.size == 1:
            return RankSlice(full, 1, 0)
        per_rank = -(-full // (self.size * VOCAB_PAD)) * VOCAB_PAD
        return RankSlice(full, self.size, self.rank, per_rank)


SINGLE = Parallelism()


def largest_tp(full: int, unit: int, up_to: int) -> int:
    """The largest tp <= up_to that splits `full` features into parts of whole `unit`s."""
    return max((t for t in range(1, up_to + 1) if full % (t * unit) == 0), default=1)


@dataclass(frozen=True)
class RankSlice:
    """Part `index` of `parts` equal parts of an axis of `full` entries (output rows or input
    channels): [start, start + length). `padded`: each part's length when the axis is padded to
    whole parts (a vocabulary); entries past `full` are zeros."""

    full: int
    parts: int
    index: int
    padded: int | None = None

    @property
    def length(self) -> int:
        return self.padded if self.padded is not None else self.full // self.parts

    @property
    def start(self) -> int:
        return self.index * self.length

    @property
    def whole(self) -> bool:
        return self.parts == 1


@dataclass(frozen=True)
class TensorSplit:
    """How one checkpoint tensor of a format follows its layer's axes: the dim of the tensor that
    runs along the output features (n_dim) and the one along the input features (k_dim). None:
    the tensor does not run along that axis (a per-tensor scale; a per-channel scale has no K),
    and every rank loads it whole along it.

    How many features an entry of a dim covers is derived from the sizes: a dim of 1536 / 128
    entries over an axis of 1536 holds 128 input channels per entry (a group scale), one of
    1536 / 8 holds 8 (int32 words of 4-bit values), one of 2 * 1536 two entries per feature. A
    rank's part must fall on whole entries, which is how a format's group and packing constraints
    are checked without code of its own. n_align / k_align: features a rank's part must be a
    multiple of besides (a layout permuted within runs of 64 output channels)."""

    n_dim: int | None
    k_dim: int | None
    n_align: int = 1
    k_align: int = 1


# The dense [N, K] weight: what bf16 checkpoints store and online formats quantize as it streams in.
DENSE_WEIGHT = TensorSplit(n_dim=0, k_dim=1)
OUTPUT_VECTOR = TensorSplit(n_dim=0, k_dim=None)  # a bias, per-channel scales [N]
WHOLE = TensorSplit(n_dim=None, k_dim=None)  # a per-tensor scale
# The dense weight a format quantizes online with scales per row: a row-parallel rank reads its
# rows whole along K, quantizes them exactly as one rank would, then keeps its columns
# (`rank_columns`), so its scales are tp=1's. Reading the rest of the row is the price.
DENSE_WEIGHT_WHOLE_ROWS = TensorSplit(n_dim=0, k_dim=None)


@dataclass(frozen=True)
class DimCut:
    """One dim of a loaded tensor cut down to this rank's entries: the concatenation of
    `segments` ((start, length) in entries; entries past `size` are zeros)."""

    dim: int
    size: int
    segments: tuple


def axis_cut(tensor_name: str, layer_name: str, shape, dim: int, slices, axis: str, align: int = 1) -> DimCut:
    """The cut of `shape[dim]`, which runs along `axis` ("output" or "input") of a layer whose
    rank slices of that axis are `slices` (one per fused shard the tensor holds, in order).

    Raises UnsupportedError, naming the tensor, the layer and the largest tp that would work,
    when a rank's part does not fall on whole entries of the dim (or on `align` features)."""
    full = sum(s.full for s in slices)
    size = shape[dim]
    per_feature = Fraction(size, full)  # entries of the dim per feature of the axis
    if size == 0 or (per_feature.numerator != 1 and per_feature.denominator != 1):
        raise UnsupportedError(f"{layer_name}: '{tensor_name}' has {size} entries along dim {dim}, which do not "
                               f"divide the layer's {full} {axis} features; the tensor cannot be sharded")

    def fits(length: int, offset: int) -> bool:
        return (length * per_feature).denominator == 1 and (offset * per_feature).denominator == 1 \
            and length % align == 0

    segments, offset = [], 0
    for s in slices:
        if not (fits(s.length, s.start + offset)):
            allowed = max((t for t in range(1, s.parts + 1) if s.full % t == 0 and fits(s.full // t, offset)), default=1)
            unit = (f"{per_feature.denominator} {axis} features per entry" if per_feature.numerator == 1
                    else f"{per_feature.numerator} entries per {axis} feature")
            aligned = f", in runs of {align} features" if align > 1 else ""
            raise UnsupportedError(
                f"{layer_name}: split into {s.parts} parts of {s.length} {axis} features, '{tensor_name}' does not "
                f"divide on whole entries (dim {dim} holds {unit}{aligned}: a group, a packed word or a block); "
                f"the largest tp this layer allows is {allowed}")
        segments.append((int((offset + s.start) * per_feature), int(s.length * per_feature)))
        offset += s.full
    return DimCut(dim, size, tuple(segments))


def stored_entries(start: int, length: int, size: int) -> int:
    """How many of a segment's `length` entries from `start` lie within a dim of `size` entries
    (the rest, past the end of a padded vocabulary, are zeros)."""
    return max(min(start + length, size) - start, 0)


def zero_padded(piece: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`piece` with zeros appended along `dim` up to `length` entries."""
    missing = length - piece.shape[dim]
    if missing == 0:
        return piece
    pad_shape = list(piece.shape)
    pad_shape[dim] = missing
    return torch.cat([piece, piece.new_zeros(pad_shape)], dim=dim)


def cut_tensor(tensor: torch.Tensor, cuts) -> torch.Tensor:
    """The rank's part of a whole loaded tensor (for readers that cannot read a slice)."""
    for cut in cuts:
        pieces = [zero_padded(tensor.narrow(cut.dim, start, stored_entries(start, length, cut.size)), length, cut.dim)
                  for start, length in cut.segments]
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=cut.dim)
    return tensor.contiguous()


def rank_columns(layer, quantized: torch.Tensor, channels_per_entry: int = 1) -> torch.Tensor:
    """This rank's columns (input channels along the last dim) of a tensor quantized from whole
    rows: all of them unless `layer` is row-parallel. channels_per_entry: the group size for
    group scales (the rank's part must hold whole groups, which the format checks)."""
    part = layer.k_slice
    if part is None:
        return quantized
    return quantized.narrow(-1, part.start // channels_per_entry, part.length // channels_per_entry)


# ---- collectives ---------------------------------------------------------------------------------
# What qrt_cpu::shm_all_reduce sums (in fp32, rounding once); other dtypes go through the group.
SHM_DTYPES = (torch.bfloat16, torch.float32)


def all_reduce(x: torch.Tensor, parallel: Parallelism) -> torch.Tensor:
    """Sum of `x` over the ranks (the partial results of a row-parallel layer)."""
    if parallel.shm_handle is not None and x.dtype in SHM_DTYPES:
        return torch.ops.qrt_cpu.shm_all_reduce(x, parallel.shm_handle)
    return collectives.all_reduce(x, "sum", parallel.group)


def all_gather_last(x: torch.Tensor, parallel: Parallelism) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dim (vocab-parallel logits)."""
    return collectives.all_gather_tensor(x.contiguous(), x.dim() - 1, parallel.group)
