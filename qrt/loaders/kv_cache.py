"""FP8 KV cache scales from ModelOpt and compressed-tensors checkpoints.

The cache holds k / k_scale cast to e4m3 and is read back as k_fp8 * k_scale (same for v).
"""

from functools import partial

import torch

from qrt.kernels.fp8_reference import FP8_DTYPE, FP8_MAX

from .errors import TensorMismatch
from .parameters import make_parameter

# Checkpoint names of KV scales -> the attention-level names qrt loads them under.
KV_SCALE_RENAMES = (
    (".k_proj.k_scale", ".k_scale"),  # ModelOpt export
    (".v_proj.v_scale", ".v_scale"),
    (".k_proj.output_scale", ".k_scale"),  # older compressed-tensors exports
    (".v_proj.output_scale", ".v_scale"),
)


def _load_kv_scale(param, loaded, shard_id, *, family: str):
    if loaded.numel() != 1 or not loaded.dtype.is_floating_point:
        raise TensorMismatch(f"shape {list(loaded.shape)} {loaded.dtype}, expected one float KV-cache scale")
    value = float(loaded.reshape(()))
    if not value > 0 or value == float("inf"):
        raise TensorMismatch(f"KV-cache scale {value}; a scale must be a positive finite multiplier")
    if family == "modelopt":
        # ModelOpt's exporter clamps FP8 KV scales to at least 1.0; older exports did not, and
        # a smaller scale would overflow e4m3 on large keys. Apply the same floor.
        value = max(value, 1.0)
    param.data.fill_(value)


def create_kv_scales(attention, family: str) -> None:
    for name in ("k_scale", "v_scale"):
        setattr(attention, name, make_parameter(
            torch.empty(1),  # [1] fp32
            weight_loader=partial(_load_kv_scale, family=family), quant_format="fp8 kv cache",
        ))


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B, KVH, T, hd] activations -> e4m3 codes to store in the cache."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (cache.float() * scale).to(dtype)
