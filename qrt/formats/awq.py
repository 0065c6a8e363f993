"""AWQ checkpoints in AutoAWQ's GEMM layout (`version: "gemm"`), 4-bit (and 8-bit).

Tensors per linear (docs/formats.md §2): `qweight` int32 [K, N / pf] and `qzeros` int32
[K / G, N / pf], both packed along N with an interleaved field order, and `scales` [K / G, N].
Zero points are stored as they are (no GPTQ-style offset): W[n, k] = (q[k, n] - z[g, n]) * s[g, n].
"""

import re
from dataclasses import dataclass
from functools import partial

import torch

from qrt.kernels.int_reference import IntWeights, pack_factor, unpack_rows

from qrt.errors import ConfigError, UnsupportedError
from qrt.formats.int_weights import copy_ints, install_int_weights, remove_parameters, scaled_shards
from qrt.layers.linear import LinearMethod, copy_rows, make_parameter
from qrt.layers.tensor_parallel import TensorSplit
from qrt.formats.scheme import QuantScheme
from qrt.formats.registry import stored_format

# Field i of a word holds output channel pf * j + ORDER[i]; reading channel p from field
# REVERSE[p] undoes it. 4-bit: ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; 8-bit: [0, 2, 1, 3] (its own inverse).
_REVERSE_ORDER = {4: (0, 4, 1, 5, 2, 6, 3, 7), 8: (0, 2, 1, 3)}


@dataclass(frozen=True)
class AwqConfig:
    bits: int
    group_size: int

    def describe(self) -> str:
        return f"AWQ {self.bits}-bit g{self.group_size}"


def unpack_awq(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C / pf] packed along columns in AWQ order -> int32 [R, C] in channel order."""
    rows, cols = words.shape[0], words.shape[1] * pack_factor(bits)
    fields = unpack_rows(words.t().contiguous(), bits, cols).t()  # [R, C], column pf*j + i = field i
    return fields.reshape(rows, -1, pack_factor(bits))[:, :, list(_REVERSE_ORDER[bits])].reshape(rows, cols)


class AwqLinearMethod(LinearMethod):
    name = "awq"
    # qweight [K, N / pf], qzeros [K / G, N / pf], scales [K / G, N]: all run along both axes.
    shard_rule = {"qweight": TensorSplit(1, 0), "qzeros": TensorSplit(1, 0), "scales": TensorSplit(1, 0)}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        cfg, n, k = self.cfg, layer.output_size, layer.input_size
        pf = pack_factor(cfg.bits)
        if k % cfg.group_size:
            raise UnsupportedError(f"{self.module_names[0]}: AWQ needs the {k} input channels to be a multiple of "
                                   f"group_size={cfg.group_size}")
        if n % pf:
            raise UnsupportedError(f"{self.module_names[0]}: AWQ packs {pf} output channels per word; {n} is not "
                                   f"a multiple")
        packed = scaled_shards(layer, pf, "AWQ qweight/qzeros")
        ints = partial(copy_ints, layout=packed, dtype=torch.int32)
        layer.qweight = make_parameter(
            torch.empty(k, n // pf, dtype=torch.int32),  # [K, N / pf], pf values along N per word
            weight_loader=ints, input_dim=0, output_dim=1, packed_dim=1, packed_factor=pf, quant_format=self.name,
        )
        layer.qzeros = make_parameter(
            torch.empty(k // cfg.group_size, n // pf, dtype=torch.int32),  # [K / G, N / pf]
            weight_loader=ints, output_dim=1, packed_dim=1, packed_factor=pf, quant_format=self.name,
        )
        layer.scales = make_parameter(
            torch.empty(k // cfg.group_size, n, dtype=torch.float32),  # [K / G, N]; fp16 on disk, held exactly
            weight_loader=partial(copy_rows, layout=layer.shard_layout), output_dim=1, quant_format=self.name,
        )

    def process_after_loading(self, layer, device: torch.device) -> None:
        cfg = self.cfg
        q = unpack_awq(layer.qweight.data, cfg.bits)  # [K, N]
        zeros = unpack_awq(layer.qzeros.data, cfg.bits).float()  # [K / G, N]
        weights = IntWeights(q, layer.scales.data, zeros, cfg.bits, cfg.group_size)
        remove_parameters(layer, "qweight", "qzeros", "scales")
        self.layout = install_int_weights(layer, weights, device, cfg.describe())

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x, self.cfg.bits, self.cfg.group_size)


def awq_config(config: dict, source) -> AwqConfig:
    """AwqConfig from a `quantization_config` dict or AutoAWQ's quant_config.json side file."""
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedError(f"{source}: AWQ version {version!r} is not supported; supported: 'gemm' "
                               f"(re-export with AutoAWQ's GEMM version)")
    bits = config.get("bits", config.get("w_bit"))
    if bits not in _REVERSE_ORDER:
        raise UnsupportedError(f"{source}: AWQ bits={bits!r} is not supported; supported: {sorted(_REVERSE_ORDER)}")
    if config.get("zero_point") is False:
        raise UnsupportedError(f"{source}: AWQ without zero points is not a GEMM-layout checkpoint")
    group = config.get("group_size", config.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise ConfigError(f"{source}: AWQ group_size={group!r}; expected a positive integer")
    return AwqConfig(bits, group)


def _reads_as_awq(config: dict) -> bool:
    """AutoAWQ's quant_config.json says zero_point or version; AutoGPTQ's says neither."""
    return "zero_point" in config or "version" in config


@stored_format("awq", computes=("qrt.int_linear",),
               summary="AWQ 4/8-bit in AutoAWQ's GEMM layout", claims_side_file=_reads_as_awq)
def awq_scheme(config: dict, source) -> QuantScheme:
    cfg = awq_config(config, source)
    # modules_to_not_convert entries match as substrings of module names.
    skip = ["re:.*" + re.escape(name) for name in config.get("modules_to_not_convert") or ()]
    return QuantScheme("awq", lambda names: AwqLinearMethod(cfg, names), skip, cfg.describe())
