"""Plain-torch references of the fused "compute the activation, then quantize it to int8 per
token" kernels (int8_fused_triton.py), which the fuse_act_quant pass puts before W8A8/W4A8 GEMMs.

Each is exactly the unfused computation: the model's op in the model dtype (the same roundings
as runtime/models/layers.py), then `quantize_rows_int8`. Shapes: input [..., D] -> (q int8
[..., D'], scale fp32 [..., 1]).
"""

import torch
import torch.nn.functional as F

from .int8_reference import quantize_rows_int8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The models' RMSNorm: normalise in fp32, scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: y = [gate | up] -> silu(gate) * up."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _quantize(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale, _ = quantize_rows_int8(h.reshape(-1, h.shape[-1]))
    return q.reshape(h.shape), scale.reshape(*h.shape[:-1], 1)


def rms_norm_quant_int8_reference(x, weight, eps: float):
    """x: [..., D]; weight: [D]. Returns (q int8 [..., D], scale fp32 [..., 1])."""
    return _quantize(rms_norm(x, weight, eps))


def silu_mul_quant_int8_reference(y):
    """y: [..., 2I]. Returns (q int8 [..., I], scale fp32 [..., 1])."""
    return _quantize(silu_mul(y))
