"""FP8 (e4m3) weights with per-output-channel scales, quantized online from a bf16 checkpoint.

`quant="fp8"`: each bf16 weight is quantized the moment it streams in (its weight_loader does
it), so the model never holds a layer in both bf16 and fp8. Activations are quantized per token
at run time. Per-channel scales make fused q/k/v and gate/up trivial: every row keeps its own.

Loader pass (`process_after_loading`): the device's kernel (kernels/choices.py) packs the weights in its layout:
- "fp8": fp8 weights as stored, for the Triton fp8 GEMM on CUDA (`qrt::fp8_linear_triton`) and
  for qrt's own CPU kernel (`qrt::fp8_linear_native_cpu`, kernels/fp8_native_cpu.py), which widens
  the bytes in registers and so reads half of bf16's bytes per token.
- CPU, "widened", where that kernel cannot build (no AVX-512 BF16/VBMI, no compiler): every e4m3
  value is exactly representable in bf16, so the weights are widened once to the model dtype. The
  numerics stay those of fp8 and the matmul runs at bf16 speed, at bf16's memory.
"""

from functools import partial

import torch

import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.choices import choose
from qrt.kernels.fp8_reference import DYNAMIC_TOKEN, FP8_DTYPE, Fp8Weights, quantize_rows_fp8

from qrt.errors import TensorMismatch
from qrt.layers.tensor_parallel import DENSE_WEIGHT_WHOLE_ROWS, rank_columns
from qrt.layers.linear import LinearMethod, ShardLayout, check_shape, install_packed, make_parameter
from qrt.formats.int_online import INT8_LM_HEAD
from qrt.formats.registry import online_format


def _quantize_into(param, loaded: torch.Tensor, shard_id, *, layer):
    """weight_loader of the fp8 weight: quantize a bf16 shard and write its codes and scales.

    Bound to the layer rather than to its scale Parameter, which is replaced when the model is
    moved off the meta device."""
    layout: ShardLayout | None = layer.shard_layout
    if not loaded.dtype.is_floating_point or loaded.dtype == FP8_DTYPE:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected a bf16/fp16/fp32 weight to quantize")
    rows = param.data if layout is None else layout.rows(param.data, shard_id)
    check_shape(loaded, (rows.shape[0], layer.full_input_size))
    codes, scales = quantize_rows_fp8(loaded)  # [n, K] fp8, [n, 1] fp32
    rows.copy_(rank_columns(layer, codes))
    scales_param = layer.weight_scale.data
    scale_rows = scales_param if layout is None else layout.rows(scales_param, shard_id)
    scale_rows.copy_(scales.squeeze(1))


class Fp8OnlineLinearMethod(LinearMethod):
    name = "fp8"
    shard_rule = {"weight": DENSE_WEIGHT_WHOLE_ROWS}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        # Filled by the weight's loader, never read from the checkpoint: no weight_loader.
        layer.weight_scale = make_parameter(
            torch.empty(n, dtype=torch.float32),  # [N] fp32, one scale per output channel
            output_dim=0, quant_format=self.name,
        )
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=FP8_DTYPE),  # [N, K] e4m3
            weight_loader=partial(_quantize_into, layer=layer),
            input_dim=1, output_dim=0, quant_format=self.name,
        )

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x, DYNAMIC_TOKEN, "weight_scale")

    def process_after_loading(self, layer, device: torch.device) -> None:
        kernel = choose("qrt.fp8_linear", device.type)
        weights = Fp8Weights(layer.weight.data, layer.weight_scale.data, "weight_scale")
        install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op)
        self.layout = kernel.layout


# lm_head is quantized too, to int8 per channel with bf16 activations, as the weight-only formats
# do (int_online.py): kept in bf16 it was a third of the bytes read per decoded token on the
# default model (57 of 164 MB), its GEMV 2.2 ms of a 12 ms step. fp8 per channel, like the layers,
# cost 4 points of top-1 agreement with bf16 there (0.932 -> 0.891 in one run of
# `python -m bench.agreement --quant fp8`), int8 none (0.938).
@online_format("fp8", computes=("qrt.fp8_linear",),
               summary="e4m3 weights per channel, activations per token", **INT8_LM_HEAD)
def fp8_online_method(module_names) -> Fp8OnlineLinearMethod:
    return Fp8OnlineLinearMethod(module_names=module_names)
