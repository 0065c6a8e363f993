"""`quant="w8a8"`: int8 weights per output channel, quantized from a bf16 checkpoint while it loads,
with int8 activations quantized dynamically per token at run time (`qrt::int8_linear`).

Each weight is quantized the moment it streams in (its weight_loader does it), so the model
never holds a layer in both bf16 and int8. Symmetric codes in [-127, 127] with an fp32 scale per
row (amax / 127), so fused q/k/v and gate/up rows simply keep their own scales.
"""

from functools import partial

import torch

import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.int8_reference import MIN_SCALE, Int8Weights

from qrt.formats.compressed_tensors.int_w8a8 import install_int8_weights
from qrt.errors import TensorMismatch
from qrt.layers.tensor_parallel import DENSE_WEIGHT_WHOLE_ROWS, rank_columns
from qrt.kernels.exact_division import divide_exactly
from qrt.layers.linear import LinearMethod, check_shape, make_parameter
from qrt.formats.registry import online_format


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [n, K] float. Returns (q [n, K] int8 in [-127, 127], scale [n] fp32), w ≈ q * scale."""
    w32 = w.float()
    scale = divide_exactly(w32.abs().amax(dim=1), 127.0).clamp(min=MIN_SCALE)  # [n] fp32
    q = (w32 / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [n, K]
    return q, scale


def _quantize_into(param, loaded: torch.Tensor, shard_id, *, layer):
    """weight_loader of the int8 weight: quantize a float shard and write its codes and scales."""
    if not loaded.dtype.is_floating_point or loaded.dtype.itemsize == 1:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected a bf16/fp16/fp32 weight to quantize")
    shards = layer.shard_layout
    rows = param.data if shards is None else shards.rows(param.data, shard_id)
    check_shape(loaded, (rows.shape[0], layer.full_input_size))
    codes, scales = quantize_weight_int8(loaded)  # [n, K] int8, [n] fp32
    rows.copy_(rank_columns(layer, codes))
    scale_rows = layer.weight_scale.data if shards is None else shards.rows(layer.weight_scale.data, shard_id)
    scale_rows.copy_(scales)


class W8A8OnlineLinearMethod(LinearMethod):
    name = "w8a8"
    shard_rule = {"weight": DENSE_WEIGHT_WHOLE_ROWS}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        # Filled by the weight's loader, never read from the checkpoint: no weight_loader.
        layer.weight_scale = make_parameter(torch.empty(n, dtype=torch.float32), output_dim=0,  # [N] fp32
                                            quant_format=self.name)
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=torch.int8),  # [N, K] in [-127, 127]
            weight_loader=partial(_quantize_into, layer=layer), input_dim=1, output_dim=0, quant_format=self.name,
        )

    def process_after_loading(self, layer, device: torch.device) -> None:
        weights = Int8Weights(layer.weight.data, layer.weight_scale.data)
        self.layout = install_int8_weights(layer, weights, device, "int8 channel weights, int8 per-token activations "
                                                                   "(online)")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x)


@online_format("w8a8", computes=("qrt.int8_linear",), summary="int8 weights per channel, int8 activations per token")
def w8a8_online_method(module_names) -> W8A8OnlineLinearMethod:
    return W8A8OnlineLinearMethod(module_names=module_names)
