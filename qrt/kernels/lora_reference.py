"""`qrt::lora_delta`: each batch row's LoRA product over stacked adapter slots (layers/lora.py),
the S-LoRA / Punica "gathered" shape: row b reads the pair of adapter slot rows[b].

An opaque op rather than inline ATen code: Inductor calls it as it is instead of generating code
for its gathers in every graph that holds an adapted layer (which doubled a model's compile
time), and a device kernel can later serve it without any change to the layers.
"""

import torch


@torch.library.custom_op("qrt::lora_delta", mutates_args=())
def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, ..., K]; a [S, W, K] and b [S, N, W] (W: the rank, times the shards of a fused layer);
    rows [R >= B] int64, the adapter slot of each batch row. Returns b[rows[i]] @ a[rows[i]] @ x[i]
    for each row i: [B, ..., N] in x's dtype (each product rounded to it, as PEFT's two Linears do)."""
    batch, in_features = x.shape[0], x.shape[-1]
    slot = rows[:batch]  # [B]
    flat = x.reshape(batch, -1, in_features)  # [B, T, K]
    shrunk = torch.bmm(flat, a[slot].transpose(1, 2))  # [B, T, W]
    delta = torch.bmm(shrunk, b[slot].transpose(1, 2))  # [B, T, N]
    return delta.reshape(*x.shape[:-1], b.shape[1])


@lora_delta.register_fake
def _(x, a, b, rows):
    return x.new_empty(*x.shape[:-1], b.shape[1])
