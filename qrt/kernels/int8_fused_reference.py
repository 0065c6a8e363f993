"""Plain-torch references of the fused "compute the activation, then quantize it to int8 per
token" kernels (int8_fused_triton.py), which the fuse_act_quant pass puts before W8A8/W4A8 GEMMs.

Each is exactly the unfused computation: the models' op (activation_reference.py), then
`quantize_rows_int8`. Shapes: input [..., D] -> (q int8
[..., D'], scale fp32 [..., 1]).
"""

import torch

from .activation_reference import act_mul, rms_norm
from .int8_reference import quantize_rows_int8


def _quantize(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale, _ = quantize_rows_int8(h.reshape(-1, h.shape[-1]))
    return q.reshape(h.shape), scale.reshape(*h.shape[:-1], 1)


def rms_norm_quant_int8_reference(x, weight, eps: float, unit_offset: bool = False):
    """x: [..., D]; weight: [D]. Returns (q int8 [..., D], scale fp32 [..., 1])."""
    return _quantize(rms_norm(x, weight, eps, unit_offset))


def silu_mul_quant_int8_reference(y):
    """y: [..., 2I]. Returns (q int8 [..., I], scale fp32 [..., 1])."""
    return _quantize(act_mul(y, "silu"))
