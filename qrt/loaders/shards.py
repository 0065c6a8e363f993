"""Where a checkpoint tensor lands in a (possibly fused) linear layer's parameters.

A fused layer (q/k/v or gate/up) stacks its shards along the output dim. The checkpoint stores
each shard as its own tensor, so each arrives with a shard id and is written into its rows.
"""

from dataclasses import dataclass

import torch

from .errors import TensorMismatch


@dataclass(frozen=True)
class ShardLayout:
    """Output rows of each shard of a fused layer: shard id -> (offset, size)."""

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

    def rows(self, tensor: torch.Tensor, shard_id, dim: int = 0) -> torch.Tensor:
        """The view of `tensor` holding shard `shard_id` (the whole tensor for shard None)."""
        if shard_id is None:
            return tensor
        if shard_id not in self.offsets:
            raise TensorMismatch(f"unknown shard {shard_id!r}; this layer has {list(self.offsets)}")
        start, size = self.offsets[shard_id]
        return tensor.narrow(dim, start, size)


def check_shape(loaded: torch.Tensor, expected: torch.Size, what: str = "tensor") -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise TensorMismatch(
            f"{what} has shape {list(loaded.shape)}, expected {list(expected)}"
        )


def copy_rows(param, loaded: torch.Tensor, shard_id, *, layout: ShardLayout | None) -> None:
    """weight_loader for plain tensors: copy (with dtype conversion) into the shard's rows."""
    dst = param.data if layout is None else layout.rows(param.data, shard_id, param.output_dim)
    check_shape(loaded, dst.shape)
    # Any float width converts, but a 1-byte float (fp8) into a wider parameter means the
    # checkpoint is quantized where qrt expects plain weights: its scale would be lost.
    if not loaded.dtype.is_floating_point or (loaded.dtype.itemsize == 1 < dst.dtype.itemsize):
        raise TensorMismatch(f"dtype {loaded.dtype}, expected {dst.dtype} (or another 2- or 4-byte float)")
    dst.copy_(loaded)
