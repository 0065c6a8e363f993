"""bitsandbytes 8-bit weights (LLM.int8()), as transformers saves a `Linear8bitLt`
(docs/formats.md §14).

Tensors per linear, P the module's prefix:
- `P.weight` int8 [N, K]: each row rounded to round(W · 127 / absmax of the row);
- `P.SCB` fp32 [N]: each row's absmax;
- `P.weight_format` uint8 []: the layout of `weight`; 0 ("row", row-major) is the only one
  bitsandbytes still writes.
bitsandbytes dequantizes as (q · SCB) · c in fp32, c = 1/127 rounded to fp32. qrt runs the layer as
int8 weight-only per output channel (`IntWeights`, the path of `quant="int8"`) with the scale
SCB · c: one rounding where bitsandbytes takes two, so each weight is within an fp32 ulp of its
dequantization (no single scale reproduces both roundings for every code). bitsandbytes' own
matmul also rounds the activations to int8 (with outlier columns kept in floats); qrt keeps them
in the model dtype, as transformers' dequantized model does.
"""

from functools import partial

import torch

from qrt.kernels.int_reference import IntWeights

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.int_weights import copy_ints, install_int_weights, remove_parameters
from qrt.layers.linear import LinearMethod, copy_rows, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT, OUTPUT_VECTOR, WHOLE

RECIPROCAL_127 = 7.874015718698502e-3  # bitsandbytes' 1 / 127, applied in fp32
ROW_MAJOR = 0  # weight_format "row"


def _check_row_major(param, loaded, shard_id):
    if loaded.numel() != 1 or loaded.dtype != torch.uint8:
        raise TensorMismatch(f"{loaded.dtype} {list(loaded.shape)}, expected one uint8 weight format code")
    if int(loaded.reshape(())) != ROW_MAJOR:
        raise UnsupportedError(f"bitsandbytes weight_format {int(loaded.reshape(()))} is a GPU tile layout of "
                               f"older bitsandbytes versions; qrt reads the row-major int8 weights (format 0) that "
                               f"bitsandbytes 0.45 and later save")


class Bnb8bitLinearMethod(LinearMethod):
    name = "bitsandbytes-int8"
    shard_rule = {"weight": DENSE_WEIGHT, "SCB": OUTPUT_VECTOR, "weight_format": WHOLE}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k, shards = layer.output_size, layer.input_size, layer.shard_layout
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=torch.int8),  # [N, K] signed codes
            weight_loader=partial(copy_ints, layout=shards, dtype=torch.int8), input_dim=1, output_dim=0,
            quant_format=self.name)
        layer.SCB = make_parameter(
            torch.empty(n, dtype=torch.float32),  # [N] absmax of each row
            weight_loader=partial(copy_rows, layout=shards), output_dim=0, quant_format=self.name)
        layer.weight_format = make_parameter(
            torch.empty(0, dtype=torch.uint8),  # checked as it loads, nothing kept
            weight_loader=_check_row_major, quant_format=self.name)

    def process_after_loading(self, layer, device: torch.device) -> None:
        n, k = layer.weight.shape
        unsigned = (layer.weight.data.t().to(torch.int32) + 128).to(torch.uint8)  # [K, N] in [1, 255]
        scales = (layer.SCB.data.float() * RECIPROCAL_127).view(1, n)  # [1, N] fp32
        weights = IntWeights(unsigned, scales, torch.full_like(scales, 128.0), 8, k)
        remove_parameters(layer, "weight", "SCB", "weight_format")
        self.layout = install_int_weights(layer, weights, device, self.cfg.describe())

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x, 8, layer.input_size)
