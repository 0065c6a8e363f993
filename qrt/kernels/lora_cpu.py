"""The CPU kernel of `qrt::lora_add`: `qrt_cpu::lora_add` (csrc/lora_cpu.cpp), where qrt's
library is built, for bf16 and fp32 models.

A layer's adapter pairs are read once per token at decode (dot products over the row's slot, in
place, and the sum with the base's output in the same pass), and gathered for ATen's batched GEMM
from 16 tokens on; the compiled graph's C++ wrapper calls it with no Python in between. Numerics as the reference's (lora_reference.py): the shrink
rounded to the model dtype before the expand, fp32 sums, in another order.
"""

import torch

from . import native_cpu


def lora_add_op(device: torch.device, dtype: torch.dtype):
    """The op an adapted layer's sum runs on `device` in `dtype`: qrt's kernel where it serves,
    else the reference."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and native_cpu.available():
        return torch.ops.qrt_cpu.lora_add
    return torch.ops.qrt.lora_add
