"""MXFP4 (OCP Microscaling FP4): 4-bit E2M1 codes with one E8M0 power-of-two scale per 32 input
channels, `quant_method: "mxfp4"` as gpt-oss ships it (docs/formats.md).

Tensors per linear, in nn.Linear orientation:
- `weight_blocks`, uint8 [N, K / 32, 16]: each block's 32 codes two a byte, the even channel in
  the low nibble;
- `weight_scales`, uint8 [N, K / 32]: the block's exponent e, its scale 2 ** (e - 127).
gpt-oss stores its experts so (`experts.gate_up_proj_blocks` [E, 2I, D / 32, 16], ...), one tensor
for every expert, which models/gpt_oss.py hands to each expert's layer under these names.
`modules_to_not_convert` lists what stays dense (gpt-oss: attention, routers, embeddings, lm_head).

The loader pass describes the weights as `Lut4Weights` for `qrt::lut4_linear`.
"""

import re
from functools import partial

import torch

from qrt.kernels.choices import choose
from qrt.kernels.lut4_reference import Lut4Weights, e2m1_table, unpack_nibbles

from qrt.errors import ConfigError, UnsupportedError
from qrt.formats.int_weights import copy_ints, remove_parameters
from qrt.formats.registry import stored_format
from qrt.formats.scheme import QuantScheme
from qrt.layers.linear import LinearMethod, install_packed, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT

BLOCK = 32  # input channels per E8M0 scale
BLOCK_BYTES = BLOCK // 2


def mxfp4_weights(blocks: torch.Tensor, scales: torch.Tensor) -> Lut4Weights:
    """blocks uint8 [N, K / 32, 16] and scales uint8 [N, K / 32], as stored -> the neutral form."""
    n = blocks.shape[0]
    codes = unpack_nibbles(blocks.reshape(n, -1))  # [N, K]
    return Lut4Weights(codes, e2m1_table(), BLOCK, scales, "e8m0")


class Mxfp4LinearMethod(LinearMethod):
    name = "mxfp4"
    # A rank's part of K must be whole blocks; axis_cut checks it from the tensors' sizes.
    shard_rule = {"weight_blocks": DENSE_WEIGHT, "weight_scales": DENSE_WEIGHT}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        if k % BLOCK:
            raise UnsupportedError(f"{self.module_names[0]}: MXFP4 needs input channels in whole blocks of {BLOCK}; "
                                   f"this layer has {k}")
        load = partial(copy_ints, layout=layer.shard_layout, dtype=torch.uint8)
        layer.weight_blocks = make_parameter(
            torch.empty(n, k // BLOCK, BLOCK_BYTES, dtype=torch.uint8),  # [N, K / 32, 16]: two codes a byte
            weight_loader=load, input_dim=1, output_dim=0, quant_format=self.name)
        layer.weight_scales = make_parameter(
            torch.empty(n, k // BLOCK, dtype=torch.uint8),  # [N, K / 32]: E8M0 exponents
            weight_loader=load, input_dim=1, output_dim=0, group_size=BLOCK, quant_format=self.name)

    def process_after_loading(self, layer, device: torch.device) -> None:
        weights = mxfp4_weights(layer.weight_blocks.data, layer.weight_scales.data)
        kernel = choose("qrt.lut4_linear", device.type, weights=weights, dtype=layer.params_dtype)
        remove_parameters(layer, "weight_blocks", "weight_scales")
        install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op, quant_format=self.name)
        self.layout = kernel.layout

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x)


def not_converted_patterns(names, source) -> list[str]:
    """transformers' `modules_to_not_convert` rule as qrt ignore patterns: an entry is a regex that
    matches from the start of a module name up to a boundary between modules
    ("model.layers.*.self_attn" matches "model.layers.3.self_attn.q_proj"), or a suffix of it."""
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ConfigError(f"{source}: quantization_config.modules_to_not_convert={names!r}; expected a list of "
                          f"module names")
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    patterns = []
    for name in names:
        patterns += [f"re:(?:{name}){boundary}", f"re:.*{re.escape(name)}$"]
    return patterns


@stored_format("mxfp4", computes=("qrt.lut4_linear",),
               summary="MXFP4 (FP4 E2M1 codes, an E8M0 scale per 32 input channels; gpt-oss's experts)")
def mxfp4_scheme(config: dict, source) -> QuantScheme:
    skip = not_converted_patterns(config.get("modules_to_not_convert") or [], source)
    return QuantScheme("mxfp4", lambda names: Mxfp4LinearMethod(module_names=names), skip, "MXFP4 (e8m0 scales per 32)")
