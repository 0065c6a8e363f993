"""Linear layers stored as plain bf16/fp16/fp32 weights: the format with no quantization."""

from functools import partial

import torch

from qrt.kernels.choices import choose
from qrt.kernels.onednn_cpu import dense_linear

from qrt.layers.tensor_parallel import DENSE_WEIGHT
from qrt.layers.linear import LinearMethod, copy_rows, make_parameter


class UnquantizedLinearMethod(LinearMethod):
    name = "bf16"  # shown by inspect; the actual dtype is the model's
    stores_dense_weight = True
    shard_rule = {"weight": DENSE_WEIGHT}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=dtype),  # [N, K]
            weight_loader=partial(copy_rows, layout=layer.shard_layout), input_dim=1, output_dim=0, quant_format=self.name,
        )

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, layer.weight, layer.bias)

    def process_after_loading(self, layer, device: torch.device) -> None:
        layer.weight.storage_layout = f"{layer.weight.dtype} [N, K]".replace("torch.", "")
        layer.weight.kernel = choose("aten.linear", device.type).op
