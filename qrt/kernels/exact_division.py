"""Division by a constant that rounds alike on every device."""

import torch


def divide_exactly(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded, on the CPU and on CUDA alike.

    ATen's CUDA kernel for `tensor / python_number` multiplies by the number's reciprocal, which
    can land one ulp from the true quotient; quantization scales computed that way differ from the
    CPU's and from the Triton kernels' (which divide with div_rn), and a code on a rounding edge
    then differs by a whole step. A divisor held in a tensor on x's device takes the true
    division path everywhere."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)
