"""NVFP4 activations: each group of 16 input channels rounded to FP4 E2M1 times an E4M3 block
scale found at run time, under a static per-tensor global scale (`qrt::nvfp4_round_activations`).

The definition is compressed-tensors' for input activations of type float, 4 bits, strategy
"tensor_group", group 16, dynamic "local" (llm-compressor's NVFP4 scheme); ModelOpt's NVFP4 rounds
activations the same way with its `input_scale` = 1 / global. Per group of 16 values x along K:

    s  = e4m3(global · max|x| / 6)        (0 becomes 0.125, e4m3's epsilon)
    x' = e2m1(clamp(x / (s / global), -6, 6)) · (s / global)

where e2m1 rounds to the nearest of 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6, ties to the even code
(0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). The arithmetic is fp32
and the result returns in x's dtype: the linear that follows then sees exactly the values a W4A4
kernel multiplies. A custom op, so that a compiled graph keeps the rounding whole.
"""

import torch

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_EPS = 0.125  # what a zero block scale becomes, so that no group divides by zero

# Midpoints between neighbouring E2M1 magnitudes, and the grid itself.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The midpoints at which the upper neighbour has the even code (a mantissa bit of 0).
_TIES_UP = (0.75, 1.75, 3.5)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, already within ±6) -> the nearest E2M1 value, ties to the even code."""
    magnitude = x.abs()
    midpoints = torch.tensor(_MIDPOINTS, dtype=x.dtype, device=x.device)
    # bucketize counts the midpoints strictly below each value, so a tie goes down ...
    index = torch.bucketize(magnitude, midpoints)
    # ... except at the midpoints whose upper neighbour is the even code.
    ties_up = torch.tensor(_TIES_UP, dtype=x.dtype, device=x.device)
    index = index + torch.isin(magnitude, ties_up).to(index.dtype)
    values = torch.tensor(_MAGNITUDES, dtype=x.dtype, device=x.device)[index]
    return torch.where(x < 0, -values, values)


def round_activations_reference(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 16), global_scale fp32 [] or [1] -> x rounded, in x's dtype."""
    groups = x.float().unflatten(-1, (-1, GROUP))  # [..., K / 16, 16]
    g = global_scale.float().reshape(())
    amax = groups.abs().amax(dim=-1)  # [..., K / 16]
    block = (g * (amax / E2M1_MAX)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    block = torch.where(block == 0, torch.full_like(block, E4M3_EPS), block)
    step = (block / g)[..., None]  # [..., K / 16, 1]: the value of code 1.0 in each group
    q = round_to_e2m1((groups / step).clamp(-E2M1_MAX, E2M1_MAX))
    return (q * step).flatten(-2).to(x.dtype)


@torch.library.custom_op("qrt::nvfp4_round_activations", mutates_args=())
def nvfp4_round_activations(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each group of 16 along K rounded to E2M1 times its E4M3 block scale over
    `global_scale` (fp32 [1]); same shape and dtype."""
    return round_activations_reference(x, global_scale)


@nvfp4_round_activations.register_fake
def _(x, global_scale):
    return torch.empty_like(x)
