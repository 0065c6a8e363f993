"""`qrt::lora_add`: a layer's output plus each batch row's LoRA product over stacked adapter slots
(layers/lora.py), the S-LoRA / Punica "gathered" shape: row b reads the pair of adapter slot rows[b].

An opaque op rather than inline ATen code: Inductor calls it as it is instead of generating code
for its gathers in every graph that holds an adapted layer (which doubled a model's compile
time), and a device kernel serves it in its place without any change to the layers
(lora_cpu.py).
"""

import torch


@torch.library.custom_op("qrt::lora_add", mutates_args=())
def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y [B, ..., N] (the base layer's output) + each row's product. x [B, ..., K]; a [S, W, K] and
    b [S, W, N] (W: the rank, times the shards of a fused layer; b holds B transposed, so that an
    expand reads N contiguous values per rank column); rows [R >= B] int64, the adapter slot of
    each batch row. Row i gains (x[i] @ a[rows[i]]ᵀ) @ b[rows[i]], each product rounded to x's
    dtype (as PEFT's two Linears round), then added in y's dtype."""
    batch, in_features = x.shape[0], x.shape[-1]
    slot = rows[:batch]  # [B]
    flat = x.reshape(batch, -1, in_features)  # [B, T, K]
    shrunk = torch.bmm(flat, a[slot].transpose(1, 2))  # [B, T, W]
    delta = torch.bmm(shrunk, b[slot])  # [B, T, N]
    return y + delta.reshape(y.shape)


@lora_add.register_fake
def _(y, x, a, b, rows):
    return torch.empty_like(y, memory_format=torch.contiguous_format)
