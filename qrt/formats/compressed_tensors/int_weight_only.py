"""compressed-tensors integer weight-only checkpoints (llm-compressor W4A16 / W8A16):
`pack-quantized`, and `naive-quantized` / `int-quantized` without activation quantization.

Tensors per linear (docs/formats.md §3.4), in nn.Linear orientation (output channels first):
- pack-quantized: `weight_packed` int32 [N, ceil(K / pf)] packed along K, `weight_shape` int64 [2];
- naive/int-quantized: `weight` int8 [N, K];
- `weight_scale` [N, groups] (channel: [N, 1]), `weight_g_idx` int32 [K] with actorder "group";
- asymmetric: `weight_zero_point`, packed int32 [ceil(N / pf), groups] along N, or, in files
  written before zero-point packing existed, int8 [N, groups]. Told apart by dtype.
Values are signed with 2**(bits-1) added before packing, so a packed field is already the unsigned
q of the canonical layout; W[n, k] = (q - (zp + 2**(bits-1))) * scale. Groups of G along K may end
with a partial group (K = 576 at G = 128 gives 5 groups, the last of 64).
"""

from dataclasses import dataclass
from functools import partial

import torch

from qrt.kernels.int_reference import IntWeights, pack_factor, unpack_rows

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.int_weights import (copy_ints, g_idx_parameter, group_count, groups_split_along_k,
                                     install_int_weights, loaded_g_idx, rank_group_indices, remove_parameters,
                                     shard_slot, whole_shard_shape)
from qrt.layers.linear import LinearMethod, check_shape, copy_rows, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT, WHOLE, TensorSplit
from qrt.formats.scheme import QuantScheme
from qrt.formats.registry import CompressedTensorsGroup, compressed_tensors_format

_CHECKPOINT_TENSORS = ("weight_packed", "weight_shape", "weight", "weight_scale", "weight_zero_point", "weight_g_idx")


@dataclass(frozen=True)
class CtIntConfig:
    packed: bool  # pack-quantized; else one int8 per value (naive/int-quantized)
    bits: int
    group_size: int  # -1: one group per output channel
    symmetric: bool
    actorder: bool  # actorder "group": weight_g_idx is stored
    source: str = "config.json"

    def describe(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        sym = "" if self.symmetric else ", asymmetric"
        return f"compressed-tensors W{self.bits}A16 {group}{sym}"


def _check_weight_shape(param, loaded, shard_id, *, layer):
    """`weight_shape` is the unpadded [N, K] of one shard of the whole layer: it must be this layer's."""
    expected = whole_shard_shape(layer, shard_id)
    if loaded.numel() != 2 or [int(v) for v in loaded.reshape(-1)] != expected:
        raise TensorMismatch(f"holds {loaded.tolist()}, but the model's layer is {expected}")
    param.data[shard_slot(layer, shard_id)] = loaded.reshape(-1)


def load_zero_point(param, loaded, shard_id, *, layer, bits):
    """Packed int32 [ceil(n / pf), groups] or legacy int8 [n, groups] -> unsigned [n, groups]."""
    rows = param.data if layer.shard_layout is None else layer.shard_layout.rows(param.data, shard_id)
    n, groups = rows.shape
    if loaded.dtype == torch.int32:
        check_shape(loaded, (-(-n // pack_factor(bits)), groups), "packed zero point")
        rows.copy_(unpack_rows(loaded, bits, n))
    elif loaded.dtype == torch.int8:
        check_shape(loaded, (n, groups), "unpacked zero point")
        rows.copy_(loaded.to(torch.int32) + 2 ** (bits - 1))
    else:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected int32 (packed) or int8 zero points")


class CtIntLinearMethod(LinearMethod):
    name = "ct-int"

    def tensor_split(self, layer, param_name: str):
        # As GPTQ's: per-channel scales have no K, and act-order layers split along K keep every group.
        grouped = TensorSplit(0, 1 if groups_split_along_k(layer, self.cfg.group_size, self.cfg.actorder) else None)
        return {"weight_packed": DENSE_WEIGHT, "weight": DENSE_WEIGHT, "weight_shape": WHOLE, "weight_scale": grouped,
                "weight_zero_point": grouped, "weight_g_idx": TensorSplit(None, 0)}.get(param_name)

    def _whole_groups(self, layer) -> bool:
        return self.cfg.actorder and layer.splits_input

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        cfg, n, k = self.cfg, layer.output_size, layer.input_size
        shards = layer.shard_layout
        slots = 1 if shards is None else len(shards.shard_ids)
        group_k = layer.full_input_size if self._whole_groups(layer) else k
        groups = 1 if cfg.group_size == -1 else group_count(group_k, cfg.group_size)
        common = dict(quant_format=self.name)
        if cfg.packed:
            pf = pack_factor(cfg.bits)
            layer.weight_packed = make_parameter(
                torch.empty(n, -(-k // pf), dtype=torch.int32),  # [N, ceil(K / pf)], pf values along K per word
                weight_loader=partial(copy_ints, layout=shards, dtype=torch.int32),
                input_dim=1, output_dim=0, packed_dim=1, packed_factor=pf, **common,
            )
            layer.weight_shape = make_parameter(
                torch.empty(slots, 2, dtype=torch.int64),  # [shards, 2]: each shard's unpadded [N, K]
                weight_loader=partial(_check_weight_shape, layer=layer), **common,
            )
        else:
            layer.weight = make_parameter(
                torch.empty(n, k, dtype=torch.int8),  # [N, K] signed values
                weight_loader=partial(copy_ints, layout=shards, dtype=torch.int8), input_dim=1, output_dim=0, **common,
            )
        layer.weight_scale = make_parameter(
            torch.empty(n, groups, dtype=torch.float32),  # [N, groups]; bf16/fp16 on disk, held exactly
            weight_loader=partial(copy_rows, layout=shards), output_dim=0, **common,
        )
        if not cfg.symmetric:
            layer.weight_zero_point = make_parameter(
                torch.empty(n, groups, dtype=torch.int32),  # [N, groups] unsigned zero points
                weight_loader=partial(load_zero_point, layer=layer, bits=cfg.bits), output_dim=0, **common,
            )
        layer.weight_g_idx = g_idx_parameter(layer, **common)

    def process_after_loading(self, layer, device: torch.device) -> None:
        cfg, k = self.cfg, layer.input_size
        offset = 2 ** (cfg.bits - 1)
        if cfg.packed:
            q = unpack_rows(layer.weight_packed.data.t().contiguous(), cfg.bits, k)  # [K, N] unsigned
        else:
            q = layer.weight.data.t().to(torch.int32) + offset  # [K, N] unsigned
        scales = layer.weight_scale.data.t()  # [groups, N]
        if cfg.symmetric:
            zeros = torch.full_like(scales, float(offset))
        else:
            zeros = layer.weight_zero_point.data.t().float()  # [groups, N]
        group = k if cfg.group_size == -1 else cfg.group_size
        weights = IntWeights(q.contiguous(), scales.contiguous(), zeros.contiguous(), cfg.bits, group,
                             self._g_idx(layer))
        remove_parameters(layer, *_CHECKPOINT_TENSORS)
        self.layout = install_int_weights(layer, weights, device, cfg.describe())

    def _g_idx(self, layer) -> torch.Tensor | None:
        tensor = f"{self.module_names[0]}.weight_g_idx"
        g_idx = loaded_g_idx(layer, layer.weight_g_idx, source=self.cfg.source, module_names=self.module_names,
                             tensor=tensor,
                             required="the quantization config says actorder='group'" if self.cfg.actorder else None)
        # compressed-tensors initialises g_idx to -1, meaning "column order".
        if g_idx is None or bool((g_idx == -1).all()):
            return None
        return rank_group_indices(layer, g_idx, self.cfg.group_size, self.cfg.actorder, tensor)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        group = layer.input_size if self.cfg.group_size == -1 else self.cfg.group_size
        return self.layout.linear(layer, x, self.cfg.bits, group)


def ct_int_config(fmt: str, weights: dict, source) -> CtIntConfig:
    """CtIntConfig for a weight-only int config group (`weights` is its QuantizationArgs)."""
    bits = weights.get("num_bits", 8)
    packed = fmt == "pack-quantized"
    if bits not in ((4, 8) if packed else (2, 4, 8)):
        raise UnsupportedError(f"{source}: compressed-tensors {fmt} int{bits} weights are not supported")
    group_size = weights.get("group_size")
    strategy = weights.get("strategy") or ("channel" if group_size in (None, -1) else "group")
    if strategy == "channel":
        group_size = -1
    elif strategy != "group" or not isinstance(group_size, int) or group_size <= 0:
        raise UnsupportedError(f"{source}: compressed-tensors int weight strategy {strategy!r} (group_size="
                               f"{group_size!r}) is not supported; supported: channel, group")
    actorder = weights.get("actorder")
    if actorder not in (None, False, True, "group", "weight", "dynamic", "static"):
        raise UnsupportedError(f"{source}: compressed-tensors actorder={actorder!r} is not supported")
    return CtIntConfig(packed, bits, group_size, bool(weights.get("symmetric", True)),
                       actorder in (True, "group", "dynamic"), str(source))


_WEIGHT_ONLY_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")


@compressed_tensors_format("int weight-only", computes=("qrt.int_linear",),
                           summary="W4A16/W8A16: pack-quantized, naive-quantized or "
                           "int-quantized int weights per channel or group, act-order, symmetric or asymmetric",
                           matches=lambda g: g.fmt != "marlin-24" and g.weights.get("type") == "int"
                           and g.inputs is None)
def ct_int_scheme(group: CompressedTensorsGroup, skip, source) -> QuantScheme:
    if group.fmt not in _WEIGHT_ONLY_FORMATS:
        raise UnsupportedError(f"{source}: compressed-tensors format {group.fmt!r} with int weights is not "
                               f"supported; supported: {', '.join(_WEIGHT_ONLY_FORMATS)}")
    cfg = ct_int_config(group.fmt, group.weights, source)
    return QuantScheme("compressed-tensors", lambda names: CtIntLinearMethod(cfg, names), skip, cfg.describe())
