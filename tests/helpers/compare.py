"""The error the tests measure one output against its reference by."""

import torch


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in float64 so that the measure adds no rounding of its own."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())
