"""compressed-tensors 2:4-sparse W4A16 checkpoints, format `marlin-24` (docs/formats.md §3.8).

The producer (compressed-tensors' Marlin24Compressor) quantizes each [N, K] weight to signed 4-bit
codes (symmetric, groups of 128 along K or one group per output channel), keeps the two entries
of every run of 4 along K that 2:4 pruning left (CUTLASS's sparse encoding), and writes, per linear:
- `weight_packed` int32 [K / 32, 2N]: the kept codes + 8 as a [K / 2, N] matrix in Marlin tiles,
  eight 4-bit values per word (below);
- `meta` int16 [K / 32, 2N]: for each run of 4, the positions of its two kept entries, in
  CUTLASS's reordered metadata layout (below);
- `scale_packed` fp16 [groups, N]: the scales, transposed and, for real group quantization,
  permuted within runs of 64 output channels;
and no zero point (symmetric) nor `weight_shape` (vLLM declares one; it is loaded when present).

Nothing here runs a sparse kernel: the loader pass rebuilds the dense [K, N] unsigned codes, with
code 8 (value 0) where weights were pruned, and hands them to the dense W4A16 path
(`install_int_weights`). Every permutation keeps each run of 64 output channels in place, so the
shards of a fused q/k/v or gate/up layer (each a multiple of 64 wide) are stacked along the
output dim as stored and decoded together.
"""

from bisect import bisect_right
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from qrt.kernels.int_reference import IntWeights, unpack_rows

from qrt.errors import CheckpointError, TensorMismatch, UnsupportedError
from qrt.formats.int_weights import (copy_ints, group_count, install_int_weights, remove_parameters, shard_slot,
                                     whole_shard_shape)
from qrt.layers.linear import LinearMethod, ShardLayout, copy_rows, make_parameter
from qrt.layers.tensor_parallel import WHOLE, TensorSplit
from qrt.formats.scheme import QuantScheme
from qrt.formats.registry import CompressedTensorsGroup, compressed_tensors_format
from qrt.formats.qqq import unpermute_columns

BITS = 4
GROUP_SIZE = 128  # the only group size the producer writes
ZERO_CODE = 8  # symmetric 4-bit: stored code = value + 8
TILE = 16  # Marlin tiles are 16x16 of the [K / 2, N] kept codes
CHANNEL_BLOCK = 64  # output channels one weight-permutation run (4 tiles) or meta reordering covers
_CHECKPOINT_TENSORS = ("weight_packed", "meta", "scale_packed", "weight_shape")


@dataclass(frozen=True)
class CtMarlin24Config:
    group_size: int  # 128, or -1 for one group per output channel
    source: str = "config.json"

    def describe(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"compressed-tensors W4A16 2:4 sparse (marlin-24) {group}"


def weight_permutation() -> torch.Tensor:
    """int64 [1024]: position j of a stored run of 4 tiles holds value perm[j] of the tile-ordered
    run (tile t, row r, column c at 256t + 16r + c)."""
    perm = []
    for i in range(32):
        col = i // 4
        # Run i gathers what one thread of the kernel loads at once for its tensor-core fragment:
        # rows 2(i%4), +1, +8, +9 of one tile, four consecutive columns from 8(col % 2) + 4 * block.
        rows = (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4) + 8, 2 * (i % 4) + 9)
        firsts = [TILE * row + 256 * (col // 2) + 8 * (col % 2) + 4 * block for block in (0, 1) for row in rows]
        for step in range(4):
            perm.extend(first + step for first in firsts)
    # Within each word the 8 values are interleaved, evens then odds, the order the kernel's
    # dequantization unpacks them in.
    return torch.tensor(perm).view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)


def group_scale_permutation() -> torch.Tensor:
    """int64 [64]: within each 8, channels 0, 4, 1, 5, 2, 6, 3, 7."""
    return torch.tensor([8 * i + j for i in range(8) for j in (0, 4, 1, 5, 2, 6, 3, 7)])


def meta_positions(n: int, k: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in the stored `meta` [K / 32, 2N] of metadata word c of output channel r,
    each int64 [N, K / 16].

    CUTLASS's sparse GEMM reads the metadata as ColumnMajorInterleaved<2>: output channels are
    reordered within blocks of 64, each 2x2 block of (channel, word) is transposed, and words are
    stored two per channel, column pair after column pair. The producer then views that buffer
    as [K / 32, 2N] without moving it."""
    r = torch.arange(n, device=device)[:, None].expand(n, k // 16)
    c = torch.arange(k // 16, device=device)[None, :].expand(n, k // 16)
    # The bits of r within its block of 64, (b5 b4 b3 b2 b1 b0), move to (b1 b5 b4 b3 b0 b2).
    row = (r // 64 * 64 + (r % 2) * 2 + (r % 8) // 4 + (r % 4) // 2 * 32 + (r % 64) // 8 * 4)
    swap = (row % 2 == 0) & (c % 2 == 1)
    back = (row % 2 == 1) & (c % 2 == 0)
    shift = swap.long() - back.long()
    row, c = row + shift, c - shift
    return c // 2, 2 * row + c % 2


class InvalidMetadata(ValueError):
    """`meta` names the same position twice, or a decreasing pair, in a run of 4 of output channel
    `channel`; the producer's encoding always names two increasing positions."""

    problem = "has a run of 4 whose metadata names the same position twice or a decreasing pair"

    def __init__(self, channel: int):
        super().__init__(f"output channel {channel} {self.problem}")
        self.channel = channel


def unpack_marlin24(weight_packed: torch.Tensor, meta: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """`weight_packed` int32 [K / 32, 2N] and `meta` int16 [K / 32, 2N] -> dense unsigned codes
    int32 [K, N], code 8 where a weight was pruned."""
    words = weight_packed.t()  # [2N, K / 32]: 8 values per word along the stored row
    stored = unpack_rows(words, BITS, 16 * n).t()  # [K / 32, 16N]
    tiles = unpermute_columns(stored, weight_permutation())  # [K / 32, 16N] tile after tile
    kept = tiles.reshape(k // 32, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(k // 2, n)  # [K / 2, N]

    rows, cols = meta_positions(n, k, meta.device)
    words16 = meta[rows, cols].to(torch.int64) & 0xFFFF  # [N, K / 16], 4 runs of 4 per word
    nibbles = (words16[:, :, None] >> (4 * torch.arange(4, device=meta.device))) & 0xF  # [N, K / 16, 4]: run 4c + t
    first, second = nibbles & 0b11, nibbles >> 2  # positions within the run of the two kept values
    invalid = (first >= second).flatten(1).any(dim=1)  # [N]
    if bool(invalid.any()):
        raise InvalidMetadata(int(invalid.nonzero()[0]))
    runs = torch.arange(k // 4, device=meta.device).reshape(1, k // 16, 4)
    positions = torch.stack((4 * runs + first, 4 * runs + second), dim=-1).reshape(n, k // 2)  # [N, K / 2]
    dense = torch.full((n, k), ZERO_CODE, dtype=torch.int32, device=meta.device)  # [N, K]
    dense.scatter_(1, positions, kept.t().contiguous())
    return dense.t().contiguous()


def unpermute_scales(scale_packed: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """`scale_packed` [groups, N] -> the scales [groups, N] in channel order."""
    # The producer permutes only when groups are smaller than its `size_k`, which is the number
    # of kept rows, K / 2, not K (vLLM's test packer compares with K; the two differ only for
    # 128 < K <= 256). Otherwise it applies its "single" permutation, which is the identity.
    if group_size != -1 and group_size < k // 2:
        return unpermute_columns(scale_packed, group_scale_permutation())
    return scale_packed


def _check_weight_shape(param, loaded, shard_id, *, layer):
    """vLLM declares a `weight_shape` int64 [2]; when a file has one it must be this shard's [N, K]
    (of the whole layer, in a sharded model)."""
    expected = whole_shard_shape(layer, shard_id)
    if loaded.dtype != torch.int64 or [int(v) for v in loaded.reshape(-1)] != expected:
        raise TensorMismatch(f"holds {loaded.tolist()} ({loaded.dtype}), expected int64 {expected}")
    param.data[shard_slot(layer, shard_id)] = loaded.reshape(-1)


class CtMarlin24LinearMethod(LinearMethod):
    name = "ct-marlin-24"

    def tensor_split(self, layer, param_name: str):
        # Rows of weight_packed and meta cover 32 input channels; every permutation and the
        # metadata reordering stay within runs of 64 output channels (two columns each).
        tiles = TensorSplit(1, 0, n_align=64)
        scales = TensorSplit(1, None if self.cfg.group_size == -1 else 0, n_align=64)
        return {"weight_packed": tiles, "meta": tiles, "scale_packed": scales, "weight_shape": WHOLE}.get(param_name)

    def _group(self, k: int) -> int:
        return k if self.cfg.group_size == -1 else self.cfg.group_size

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        shards = layer.shard_layout
        widths = [n] if shards is None else [size for _, size in shards.offsets.values()]
        if any(width % CHANNEL_BLOCK for width in widths) or k % 32:
            raise UnsupportedError(f"{self.module_names[0]}: marlin-24 needs output widths that are multiples of "
                                   f"{CHANNEL_BLOCK} and an input width that is a multiple of 32; this layer has "
                                   f"outputs {widths} and {k} inputs")
        # weight_packed and meta hold two int32/int16 columns per output channel.
        doubled = None if shards is None else ShardLayout.stacked(shards.shard_ids, [2 * w for w in widths])
        common = dict(quant_format=self.name)
        layer.weight_packed = make_parameter(
            torch.empty(k // 32, 2 * n, dtype=torch.int32),  # [K / 32, 2N]: kept codes in Marlin tiles, 8 per word
            weight_loader=partial(copy_ints, layout=doubled, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=1, packed_factor=8, **common,
        )
        layer.meta = make_parameter(
            torch.empty(k // 32, 2 * n, dtype=torch.int16),  # [K / 32, 2N]: CUTLASS-reordered 2:4 metadata
            weight_loader=partial(copy_ints, layout=doubled, dtype=torch.int16), input_dim=0, output_dim=1, **common,
        )
        layer.scale_packed = make_parameter(
            torch.empty(group_count(k, self._group(k)), n, dtype=torch.float32),  # [groups, N]; fp16 on disk, exact
            weight_loader=partial(copy_rows, layout=shards), output_dim=1, **common,
        )
        layer.weight_shape = make_parameter(
            torch.empty(len(widths), 2, dtype=torch.int64),  # [shards, 2]: each shard's [N, K], when stored
            weight_loader=partial(_check_weight_shape, layer=layer), optional=True, **common,
        )

    def process_after_loading(self, layer, device: torch.device) -> None:
        n, k = layer.output_size, layer.input_size
        try:
            q = unpack_marlin24(layer.weight_packed.data, layer.meta.data, k, n)  # [K, N]
        except InvalidMetadata as err:
            module, channel = self._shard_of(layer, err.channel)
            # The loader pass no longer knows which weight file held the tensor: name the folder.
            raise CheckpointError(Path(self.cfg.source).parent, f"{module}.meta",
                                  f"output channel {channel} {err.problem}; not a valid marlin-24 export") from None
        # The producer chose whether to permute from the whole layer's K, not a rank's part of it.
        scales = unpermute_scales(layer.scale_packed.data, self.cfg.group_size, layer.full_input_size).contiguous()
        zeros = torch.full_like(scales, float(ZERO_CODE))
        weights = IntWeights(q, scales, zeros, BITS, self._group(k))
        remove_parameters(layer, *_CHECKPOINT_TENSORS)
        self.layout = install_int_weights(layer, weights, device, self.cfg.describe())

    def _shard_of(self, layer, channel: int) -> tuple[str, int]:
        """The checkpoint module holding the layer's output channel `channel`, and its index there."""
        if layer.shard_layout is None:
            return self.module_names[0], channel
        starts = [start for start, _ in layer.shard_layout.offsets.values()]
        index = bisect_right(starts, channel) - 1
        return self.module_names[index], channel - starts[index]

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x, BITS, self._group(layer.input_size))


def ct_marlin24_config(weights: dict, inputs, source) -> CtMarlin24Config:
    """CtMarlin24Config for a `marlin-24` config group, or an error naming what the format cannot hold."""
    what = f"{source}: compressed-tensors marlin-24"
    if inputs is not None:
        raise UnsupportedError(f"{what} is weight-only, but the config quantizes input activations too")
    if weights.get("type") != "int" or weights.get("num_bits") != BITS:
        raise UnsupportedError(f"{what} stores 4-bit int weights; the config says {weights.get('type')!r} "
                               f"num_bits={weights.get('num_bits')!r}")
    if not weights.get("symmetric", True):
        raise UnsupportedError(f"{what} stores symmetric weights only (no zero points); the config says "
                               f"symmetric=false")
    group_size = weights.get("group_size")
    strategy = weights.get("strategy") or ("channel" if group_size in (None, -1) else "group")
    if strategy == "channel":
        return CtMarlin24Config(-1, str(source))
    if strategy != "group" or group_size != GROUP_SIZE:
        raise UnsupportedError(f"{what} supports group_size {GROUP_SIZE} or channel weights; the config says "
                               f"strategy {strategy!r}, group_size={group_size!r}")
    if weights.get("actorder") not in (None, False):
        raise UnsupportedError(f"{what} has no group indices; actorder={weights.get('actorder')!r} cannot be stored")
    return CtMarlin24Config(GROUP_SIZE, str(source))


# 2:4 sparsity lives in the weight layout; the config's sparsity_config says "dense".
@compressed_tensors_format("marlin-24", computes=("qrt.int_linear",),
                           summary="2:4-sparse 4-bit weights in the marlin-24 layout, groups of 128 "
                           "or channels", matches=lambda group: group.fmt == "marlin-24")
def ct_marlin24_scheme(group: CompressedTensorsGroup, skip, source) -> QuantScheme:
    cfg = ct_marlin24_config(group.weights, group.inputs, source)
    return QuantScheme("compressed-tensors", lambda names: CtMarlin24LinearMethod(cfg, names), skip, cfg.describe())
