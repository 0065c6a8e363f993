"""compressed-tensors `mxfp4-pack-quantized` (llm-compressor's MXFP4A16 scheme): the OCP microscaling
FP4 of ../mxfp4.py in compressed-tensors' names (docs/formats.md §3.9).

Tensors per linear, in nn.Linear orientation:
- `weight_packed`, uint8 [N, K / 2]: two E2M1 codes a byte along K, the even channel in the low
  nibble (the byte order of gpt-oss's blocks, flattened);
- `weight_scale`, uint8 [N, K / 32]: each block's E8M0 exponent e, its scale 2 ** (e - 127)
  (compressed-tensors writes floor(log2(scale)) + 127).
No global scale (the scheme's strategy is `group`, not NVFP4's `tensor_group`).
"""

from functools import partial

import torch

from qrt.kernels.choices import choose

from qrt.errors import UnsupportedError
from qrt.formats.int_weights import copy_ints, remove_parameters
from qrt.formats.mxfp4 import BLOCK, mxfp4_weights
from qrt.formats.registry import CompressedTensorsGroup, compressed_tensors_format
from qrt.formats.scheme import QuantScheme
from qrt.layers.linear import LinearMethod, install_packed, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT

FORMAT = "mxfp4-pack-quantized"


class CtMxfp4LinearMethod(LinearMethod):
    name = "mxfp4"
    # A rank's part of K must be whole blocks of 32; axis_cut checks it from the tensors' sizes.
    shard_rule = {"weight_packed": DENSE_WEIGHT, "weight_scale": DENSE_WEIGHT}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        if k % BLOCK:
            raise UnsupportedError(f"{self.module_names[0]}: MXFP4 needs input channels in whole blocks of {BLOCK}; "
                                   f"this layer has {k}")
        load = partial(copy_ints, layout=layer.shard_layout, dtype=torch.uint8)
        layer.weight_packed = make_parameter(
            torch.empty(n, k // 2, dtype=torch.uint8),  # [N, K / 2]: two E2M1 codes a byte, low nibble first
            weight_loader=load, input_dim=1, output_dim=0, packed_dim=1, packed_factor=2, quant_format=self.name)
        layer.weight_scale = make_parameter(
            torch.empty(n, k // BLOCK, dtype=torch.uint8),  # [N, K / 32]: E8M0 exponents
            weight_loader=load, input_dim=1, output_dim=0, group_size=BLOCK, quant_format=self.name)

    def process_after_loading(self, layer, device: torch.device) -> None:
        weights = mxfp4_weights(layer.weight_packed.data, layer.weight_scale.data)
        kernel = choose("qrt.lut4_linear", device.type, weights=weights, dtype=layer.params_dtype)
        remove_parameters(layer, "weight_packed", "weight_scale")
        install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op, quant_format=self.name,
                       note="MXFP4A16 (compressed-tensors)")
        self.layout = kernel.layout

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x)


def _check_weights(args: dict, source) -> None:
    wanted = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": BLOCK, "symmetric": True}
    found = {key: args.get(key, True if key == "symmetric" else None) for key in wanted}
    if found != wanted:
        raise UnsupportedError(f"{source}: compressed-tensors format {FORMAT!r} with weights {found} is not supported; "
                               f"supported: {wanted}")


@compressed_tensors_format(FORMAT, computes=("qrt.lut4_linear",),
                           summary="MXFP4A16: FP4 E2M1 weights, an E8M0 scale per 32 input channels; "
                           "activations unquantized",
                           matches=lambda g: g.fmt == FORMAT)
def ct_mxfp4_scheme(group: CompressedTensorsGroup, skip, source) -> QuantScheme:
    _check_weights(group.weights, source)
    if group.inputs is not None:
        raise UnsupportedError(f"{source}: compressed-tensors {FORMAT!r} with quantized input activations (the MXFP4 "
                               f"scheme) is not supported; weight-only MXFP4A16 is")
    return QuantScheme("compressed-tensors", lambda names: CtMxfp4LinearMethod(module_names=names), skip,
                       "compressed-tensors MXFP4A16 (e8m0 scales per 32)")
