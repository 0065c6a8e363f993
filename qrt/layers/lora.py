"""LoRA adapters beside a `Linear`, whatever its format: the base kernel is untouched, and the
layer's output gains each row's low-rank product `scaling · B (A x)` in the model dtype.

Every adapted `Linear` holds the pairs of all resident adapters stacked by adapter slot (slot 0
holds zeros: no adapter), and all of them read one shared row table, `rows` [R]: the adapter slot
of each batch row of the step now running, written by the graph runner before each call
(runtime/lora.py). A step then gathers each row's A and B and runs the shrink and the expand as
two batched products (the S-LoRA / Punica shape), so rows with different adapters, and rows with
none, share one compiled step. Loading or dropping an adapter writes into the stacks in place:
the graphs never change, so nothing recompiles.

A fused layer (q/k/v, gate/up) stacks its shards' A along the rank axis ([n·R, K]) and keeps B
block-diagonal (held transposed, [n·R, N]: shard i's output columns read only its own R rows), so
the layer's delta is still two products, at the price of multiplying by zeros off the diagonal.

Tensor parallelism: a column-parallel layer holds A whole and its rank's rows of B; a row-parallel
one its rank's columns of A and B whole, so its delta is a partial sum like the base's, which the
layer's all-reduce adds up.
"""

import torch
from torch import nn

from qrt.kernels.lora_cpu import lora_add_op


class LoraWeights(nn.Module):
    """The adapter slots of one Linear: a [slots + 1, n·R, K] and b [slots + 1, n·R, N] (B
    transposed; slot 0 zeros), in the model dtype, with the shared row table."""

    def __init__(self, slots: int, rank: int, shard_rows: list[tuple[int, int]], input_size: int,
                 rows: torch.Tensor, dtype: torch.dtype, device):
        """shard_rows: (offset, size) of each shard's output rows in this rank's layer."""
        super().__init__()
        self.rank = rank
        self.shard_rows = list(shard_rows)
        output_size = sum(size for _, size in shard_rows)
        width = rank * len(shard_rows)
        self.register_buffer("a", torch.zeros(slots + 1, width, input_size, dtype=dtype, device=device))  # [S+1, nR, K]
        self.register_buffer("b", torch.zeros(slots + 1, width, output_size, dtype=dtype, device=device))  # [S+1, nR, N]
        self.register_buffer("rows", rows)  # [R] int64, shared by every LoraWeights of the model
        self.add_op = lora_add_op(torch.device(device), dtype)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [B, ..., N], the base's output for x [B, ..., K] -> y plus each batch row's adapter product."""
        return self.add_op(y, x, self.a, self.b, self.rows)

    @torch.no_grad()
    def write(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put one shard's pair into adapter slot `slot`: a [r, K] (this rank's columns), b [n, r]
        (this rank's rows, the scaling already in), r <= rank."""
        r = a.shape[0]
        offset, size = self.shard_rows[shard]
        if tuple(b.shape) != (size, r) or a.shape[1] != self.a.shape[2]:
            raise ValueError(f"LoRA pair A {list(a.shape)}, B {list(b.shape)} for a shard of {size} rows and "
                             f"{self.a.shape[2]} inputs")
        columns = slice(shard * self.rank, shard * self.rank + r)
        self.a[slot, columns] = a.to(self.a.dtype)
        self.b[slot, columns, offset:offset + size] = b.t().to(self.b.dtype)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def extra_repr(self) -> str:
        return f"slots={self.a.shape[0] - 1}, rank={self.rank}, shards={len(self.shard_rows)}"
