"""MXFP4 (OCP Microscaling FP4): 4-bit E2M1 codes with one E8M0 power-of-two scale per 32 input
channels, `quant_method: "mxfp4"` as gpt-oss ships it (docs/formats.md).

Tensors per linear, in nn.Linear orientation:
- `weight_blocks`, uint8 [N, K / 32, 16]: each block's 32 codes two a byte, the even channel in
  the low nibble;
- `weight_scales`, uint8 [N, K / 32]: the block's exponent e, its scale 2 ** (e - 127).
gpt-oss stores its experts so (`experts.gate_up_proj_blocks` [E, 2I, D / 32, 16], ...), one tensor
for every expert, which models/gpt_oss.py hands to each expert's layer under these names.
`modules_to_not_convert` lists what stays dense (gpt-oss: attention, routers, embeddings, lm_head).

The loader pass describes the weights as `Lut4Weights` for `qrt::lut4_linear`. compressed-tensors'
MXFP4A16 (compressed_tensors/mxfp4.py) stores the same bytes under other names, which
`Mxfp4Tensors` says.
"""

import re
from dataclasses import dataclass
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


def mxfp4_weights(codes: torch.Tensor, scales: torch.Tensor) -> Lut4Weights:
    """codes uint8 [N, K / 32, 16] or [N, K / 2] (two a byte, low nibble first) and scales uint8
    [N, K / 32], as stored -> the neutral form."""
    n = codes.shape[0]
    return Lut4Weights(unpack_nibbles(codes.reshape(n, -1)), e2m1_table(), BLOCK, scales, "e8m0")


@dataclass(frozen=True)
class Mxfp4Tensors:
    """How one producer names and shapes MXFP4's two tensors (the bytes are the same)."""

    codes: str  # uint8, two E2M1 codes a byte along K, the even channel in the low nibble
    scales: str  # uint8 [N, K / 32]: E8M0 exponents
    codes_in_blocks: bool  # [N, K / 32, 16] (gpt-oss); else [N, K / 2] (compressed-tensors)
    note: str | None = None  # what `inspect` adds to the storage line


# gpt-oss's names, which models/gpt_oss.py also hands each expert's tensors over under.
GPT_OSS_TENSORS = Mxfp4Tensors("weight_blocks", "weight_scales", codes_in_blocks=True)


class Mxfp4LinearMethod(LinearMethod):
    name = "mxfp4"

    def __init__(self, tensors: Mxfp4Tensors = GPT_OSS_TENSORS, module_names=()):
        super().__init__(tensors, module_names)
        # A rank's part of K must be whole blocks; axis_cut checks it from the tensors' sizes.
        self.shard_rule = {tensors.codes: DENSE_WEIGHT, tensors.scales: DENSE_WEIGHT}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        names, n, k = self.cfg, layer.output_size, layer.input_size
        if k % BLOCK:
            raise UnsupportedError(f"{self.module_names[0]}: MXFP4 needs input channels in whole blocks of {BLOCK}; "
                                   f"this layer has {k}")
        load = partial(copy_ints, layout=layer.shard_layout, dtype=torch.uint8)
        if names.codes_in_blocks:
            codes = make_parameter(torch.empty(n, k // BLOCK, BLOCK_BYTES, dtype=torch.uint8),  # [N, K / 32, 16]
                                   weight_loader=load, input_dim=1, output_dim=0, quant_format=self.name)
        else:
            codes = make_parameter(torch.empty(n, k // 2, dtype=torch.uint8),  # [N, K / 2]
                                   weight_loader=load, input_dim=1, output_dim=0, packed_dim=1, packed_factor=2,
                                   quant_format=self.name)
        setattr(layer, names.codes, codes)
        setattr(layer, names.scales, make_parameter(
            torch.empty(n, k // BLOCK, dtype=torch.uint8),  # [N, K / 32]: E8M0 exponents
            weight_loader=load, input_dim=1, output_dim=0, group_size=BLOCK, quant_format=self.name))

    def process_after_loading(self, layer, device: torch.device) -> None:
        names = self.cfg
        weights = mxfp4_weights(getattr(layer, names.codes).data, getattr(layer, names.scales).data)
        kernel = choose("qrt.lut4_linear", device.type, weights=weights, dtype=layer.params_dtype)
        remove_parameters(layer, names.codes, names.scales)
        install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op, quant_format=self.name,
                       note=names.note)
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
