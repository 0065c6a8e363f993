"""Ops that compute a linear layer's input, as the models call them: `qrt::rms_norm` and the gated
MLP's `qrt::act_mul`. They are ops rather than inline code so that a pass can find them by name
(the fusion pass hands an int8 GEMM its input already quantized, int8_fused_triton.py) instead of
matching a copy of their arithmetic.

Both are CompositeImplicitAutograd: compiled, they decompose into the ATen ops below and Inductor
fuses them with their neighbours as if they were written inline; eagerly they run these ops.
"""

import torch
import torch.nn.functional as F

from .choices import Fusion

_lib = torch.library.Library("qrt", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset=False) -> Tensor")
_lib.define("act_mul(Tensor y, str activation) -> Tensor")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x: [..., D], the model's dtype or the fp32 residual stream; weight: [D] in the model's
    dtype. Normalise in fp32, then
    - Llama and most families: round to the weight's dtype and scale by `weight` in that dtype;
    - unit_offset (Gemma, whose checkpoints store the offset from one): scale by 1 + weight in fp32,
      then round once.
    These are the roundings transformers makes for each family. The result is in the weight's
    dtype, which the layers after the norm take."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(weight.dtype)
    return weight * x32.to(weight.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json's hidden_act -> the activation of the gate
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


# gpt-oss's experts: the gate clamped from above, the up projection from both sides, and one
# added to it; its transformers code and OpenAI's own fix alpha and the limit at these values.
CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT = 1.702, 7.0


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate = gate.clamp(max=CLAMPED_SWIGLU_LIMIT)
    up = up.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * CLAMPED_SWIGLU_ALPHA))


# Gated activations that are not act(gate) * up: name -> f(gate, up), in y's dtype.
GATED_ACTIVATIONS = {"clamped_swiglu": _clamped_swiglu}


def act_mul(y: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's activation: y = [gate | up] ([..., 2I]) -> act(gate) * up ([..., I]), or
    the GATED_ACTIVATIONS' own combination of the two halves."""
    gate, up = y.chunk(2, dim=-1)
    if activation in GATED_ACTIVATIONS:
        return GATED_ACTIVATIONS[activation](gate, up)
    return ACTIVATIONS[activation](gate) * up


_lib.impl("rms_norm", rms_norm, "CompositeImplicitAutograd")
_lib.impl("act_mul", act_mul, "CompositeImplicitAutograd")


def int8_input_fusions(gemm: str, gemm_args) -> tuple[Fusion, ...]:
    """For a CUDA kernel that quantizes its input to int8 per token: the fused kernels
    (int8_fused_triton.py) that compute that input, an RMSNorm or silu(gate) * up, and quantize it in
    the same pass, handing `gemm` the int8 activations and their scales."""
    return (
        Fusion("qrt.rms_norm", "qrt.rms_norm_quant_int8_triton", gemm, gemm_args,
               producer_args=lambda args: (*args[:3], args[3] if len(args) > 3 else False)),
        Fusion("qrt.act_mul", "qrt.silu_mul_quant_int8_triton", gemm, gemm_args,
               producer_args=lambda args: (args[0],) if args[1] == "silu" else None),
    )
