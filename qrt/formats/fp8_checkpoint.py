"""Pre-quantized FP8 checkpoints: HF/vLLM `fp8` (per-tensor, block), ModelOpt FP8 and
compressed-tensors `float-quantized`, all e4m3 weights stored as `[N, K]`.

Fused q/k/v and gate/up shards arrive with their own per-tensor scales. qrt keeps each shard's
scale instead of requantizing to the largest (what vLLM does): a per-tensor scale is written into
the shard's rows of a per-output-channel scale vector, which the per-channel kernels consume
as is. No weight is rounded twice, and the result is exactly the checkpoint's dequantized weight.
Static input scales of fused shards are merged with max(), as every other runtime does: the
activation is quantized once for all shards.
"""

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from qrt.kernels.choices import choose
from qrt.kernels.fp8_reference import DYNAMIC_GROUP, DYNAMIC_TOKEN, FP8_DTYPE, STATIC_TENSOR, Fp8Weights

from qrt.errors import ConfigError, TensorMismatch, UnsupportedError
from qrt.layers.linear import LinearMethod, check_shape, copy_rows, install_packed, make_parameter, replace_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT, OUTPUT_VECTOR, WHOLE, TensorSplit
from qrt.formats.scheme import QuantScheme, read_json
from qrt.formats.registry import STORED, CompressedTensorsGroup, compressed_tensors_format, side_file, stored_format

@dataclass(frozen=True)
class Fp8Storage:
    """How one family stores its fp8 linears."""

    weight: str  # "tensor" | "channel" | "block"
    activation: str  # one of the schemes above
    block: tuple[int, int] | None = None  # (rows, cols) of a weight block
    scale_name: str = "weight_scale"  # HF block checkpoints say weight_scale_inv (a multiplier)

    def __post_init__(self):
        if (self.weight == "block") != (self.activation == DYNAMIC_GROUP):
            raise UnsupportedError(f"fp8 {self.weight} weights with {self.activation} activations are not supported; "
                                   f"block weights need dynamic per-group activations and vice versa")


def _load_fp8_weight(param, loaded, shard_id, *, layout):
    if loaded.dtype != FP8_DTYPE:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected float8_e4m3fn for an fp8 checkpoint weight")
    copy_rows(param, loaded, shard_id, layout=layout)


def _load_scale_into_rows(param, loaded, shard_id, *, layout):
    """A per-tensor scale ([] or [1]) fills its shard's rows; a per-channel one ([n] or [n, 1]) copies."""
    rows = param.data if layout is None else layout.rows(param.data, shard_id)
    _check_scale(loaded)
    if loaded.numel() == 1:
        rows.fill_(float(loaded.reshape(())))
    else:
        check_shape(loaded.reshape(-1), rows.shape, "per-channel scale")
        rows.copy_(loaded.reshape(-1))


def _load_input_scale(param, loaded, shard_id, *, layout):
    """Static input scales go to one slot per shard; the loader pass keeps their max."""
    _check_scale(loaded)
    if loaded.numel() != 1:
        raise TensorMismatch(f"shape {list(loaded.shape)}, expected a per-tensor input scale ([] or [1])")
    slot = 0 if layout is None else layout.shard_ids.index(shard_id)
    param.data[slot] = float(loaded.reshape(()))


def _load_block_scale(param, loaded, shard_id, *, grid):
    _check_scale(loaded)
    first, picked, checkpoint_rows = grid.rows(shard_id)
    if loaded.dim() != 2 or loaded.shape[0] != checkpoint_rows or loaded.shape[1] != param.shape[1]:
        raise TensorMismatch(f"block scale grid has shape {list(loaded.shape)}, expected [{checkpoint_rows}, "
                             f"{param.shape[1]}] (one row per {grid.block_rows} output rows, one column per block of "
                             f"input channels)")
    param.data.narrow(0, first, picked.numel()).copy_(loaded[picked])


def _check_scale(loaded):
    if not loaded.dtype.is_floating_point or loaded.dtype == FP8_DTYPE:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected a float32/bf16/fp16 scale")
    values = loaded.float()
    if not torch.isfinite(values).all() or (values <= 0).any():
        raise TensorMismatch(f"scale holds {'non-finite' if not torch.isfinite(values).all() else 'zero or negative'} "
                             f"values; a scale must be a positive finite multiplier")


BLOCK_GRID = TensorSplit(n_dim=None, k_dim=1)


class Fp8CheckpointLinearMethod(LinearMethod):
    name = "fp8"

    def __init__(self, layout: Fp8Storage, family: str):
        super().__init__(layout)
        self.family = family
        # Per-tensor scales (one per fused shard) go whole to every rank, per-channel ones follow
        # the output rows. A block-scale grid is cut along K in whole blocks; every rank reads all
        # its rows (a few hundred bytes), and its loader picks the blocks the rank's rows lie in
        # (BlockScaleRows), which need not be whole.
        weight_scale = {"tensor": WHOLE, "channel": OUTPUT_VECTOR, "block": BLOCK_GRID}[layout.weight]
        self.shard_rule = {"weight": DENSE_WEIGHT, layout.scale_name: weight_scale, "input_scale": WHOLE}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        shards = layer.shard_layout
        spec = self.cfg
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=FP8_DTYPE),  # [N, K] e4m3 as stored
            weight_loader=partial(_load_fp8_weight, layout=shards), input_dim=1, output_dim=0, quant_format=self.name,
        )
        if spec.weight == "block":
            grid = BlockScaleRows.of(layer, spec.block[0])
            layer.weight_block = (grid.rows_per_scale, spec.block[1])
            scales = torch.empty(math.ceil(n / grid.rows_per_scale), math.ceil(k / spec.block[1]))  # [N/r, K/bk] fp32
            loader = partial(_load_block_scale, grid=grid)
        else:
            scales = torch.empty(n)  # [N] fp32: per-tensor scales expanded to their shard's rows
            loader = partial(_load_scale_into_rows, layout=shards)
        setattr(layer, spec.scale_name, make_parameter(scales, weight_loader=loader, output_dim=0,
                                                       quant_format=self.name))
        if spec.activation == STATIC_TENSOR:
            slots = 1 if shards is None else len(shards.shard_ids)
            layer.input_scale = make_parameter(
                torch.empty(slots),  # [shards] fp32, merged to [1] by the loader pass
                weight_loader=partial(_load_input_scale, layout=shards), quant_format=self.name,
            )

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x, self.cfg.activation, self.cfg.scale_name)

    def process_after_loading(self, layer, device: torch.device) -> None:
        spec = self.cfg
        if spec.activation == STATIC_TENSOR:
            replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1))  # [1]
        logical = {DYNAMIC_TOKEN: "qrt.fp8_linear", STATIC_TENSOR: "qrt.fp8_static_linear",
                   DYNAMIC_GROUP: "qrt.fp8_block_linear"}[spec.activation]
        kernel = choose(logical, device.type)
        block = layer.weight_block if spec.weight == "block" else None
        weights = Fp8Weights(layer.weight.data, getattr(layer, spec.scale_name).data, spec.scale_name, block)
        install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op,
                       note=f"{spec.weight} scales, {spec.activation} activations ({self.family})")
        self.layout = kernel.layout


@dataclass(frozen=True)
class BlockScaleRows:
    """Where the rows of a block-scale grid go in one layer.

    A checkpoint's grid has a row per `block_rows` output rows of each shard (q, k, v; gate, up).
    A layer keeps one scale row per `rows_per_scale` of its own rows: block_rows when every
    shard's rows start and end on whole blocks, else the largest divisor of block_rows that all
    of them start on and (but the last) end on. A rank whose rows split a block (tp=2 of a
    128-row k_proj holds 64) then takes that block's scale for its rows, and a fused layer never
    stacks two shards' rows under one scale. The weight is unchanged: each of its rows is
    multiplied by the scale of the block it belongs to, whichever grid says so.

    shards: shard id -> (the shard's first row in this layer, its first row in the checkpoint
    tensor, its row count here, the checkpoint tensor's row count)."""

    block_rows: int
    rows_per_scale: int
    shards: dict

    @classmethod
    def of(cls, layer, block_rows: int) -> "BlockScaleRows":
        layout, slices = layer.shard_layout, layer.n_slices
        ids = (None,) if layout is None else layout.shard_ids
        sizes = [layer.output_size] if layout is None else layout.sizes
        starts = [0] * len(ids) if slices is None else [part.start for part in slices]
        offsets = [sum(sizes[:i]) for i in range(len(ids))]
        rows_per_scale = math.gcd(block_rows, *starts, *sizes[:-1])
        shards = {shard_id: (offset, start, size, full)
                  for shard_id, offset, start, size, full in zip(ids, offsets, starts, sizes, layer.full_shard_sizes,
                                                                 strict=True)}
        return cls(block_rows, rows_per_scale, shards)

    def rows(self, shard_id) -> tuple[int, torch.Tensor, int]:
        """(The shard's first scale row in the layer's grid, the checkpoint grid rows it takes in
        order, the checkpoint grid's row count)."""
        if shard_id not in self.shards:
            raise TensorMismatch(f"unknown shard {shard_id!r}; this layer has {list(self.shards)}")
        offset, start, size, full = self.shards[shard_id]
        picked = torch.arange(start, start + size, self.rows_per_scale) // self.block_rows  # [ceil(size / r)]
        return offset // self.rows_per_scale, picked, math.ceil(full / self.block_rows)


def _fp8_scheme(layout: Fp8Storage, family: str, skip, kv_cache_fp8=None) -> QuantScheme:
    block = f" {layout.block[0]}x{layout.block[1]}" if layout.block else ""
    description = f"fp8 ({family}: {layout.weight}{block} weight scales, {layout.activation} activations"
    description += ", fp8 KV cache)" if kv_cache_fp8 else ")"
    return QuantScheme("fp8", lambda names: Fp8CheckpointLinearMethod(layout, family), skip, description, kv_cache_fp8)


@stored_format("fp8", computes=("qrt.fp8_linear", "qrt.fp8_static_linear", "qrt.fp8_block_linear"),
               summary="FP8 e4m3 (HF/vLLM fp8: AutoFP8 per-tensor static or dynamic, DeepSeek-style "
               "block scales)")
def hf_fp8_scheme(config: dict, config_path) -> QuantScheme:
    activation = config.get("activation_scheme", "dynamic")
    block = config.get("weight_block_size")
    skip = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
    if block is not None:
        if activation != "dynamic" or len(block) != 2:
            raise ConfigError(f"{config_path}: fp8 weight_block_size={block} needs activation_scheme 'dynamic' "
                              f"and two block sizes")
        layout = Fp8Storage("block", DYNAMIC_GROUP, tuple(int(b) for b in block), "weight_scale_inv")
    elif activation in ("dynamic", "static"):
        layout = Fp8Storage("tensor", STATIC_TENSOR if activation == "static" else DYNAMIC_TOKEN)
    else:
        raise ConfigError(f"{config_path}: activation_scheme={activation!r}; expected 'static' or 'dynamic'")
    return _fp8_scheme(layout, "HF fp8", skip)


_MODELOPT_FP8 = {
    "FP8": Fp8Storage("tensor", STATIC_TENSOR),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Storage("channel", DYNAMIC_TOKEN),
}


def _modelopt(algo, kv_algo, skip, source) -> QuantScheme:
    algo = str(algo).upper()
    if algo not in _MODELOPT_FP8:
        # ModelOpt's other algorithms live in modules of their own, registered as the stored formats
        # "modelopt-<algo>" (modelopt_nvfp4.py), which read the same settings.
        other = STORED.get(f"modelopt-{algo.lower()}")
        if other is None:
            others = sorted(name.removeprefix("modelopt-").upper() for name in STORED if name.startswith("modelopt-"))
            raise UnsupportedError(f"{source}: ModelOpt quant_algo={algo!r} is not supported yet; supported: "
                                   f"{sorted(_MODELOPT_FP8) + others}")
        return other.read({"quant_method": other.quant_method, "quant_algo": algo, "kv_cache_quant_algo": kv_algo,
                           "ignore": list(skip)}, source)
    kv = "modelopt" if kv_algo is not None and str(kv_algo).upper() == "FP8" else None
    if kv_algo is not None and kv is None:
        raise UnsupportedError(f"{source}: ModelOpt kv_cache_quant_algo={kv_algo!r} is not supported; only FP8")
    return _fp8_scheme(_MODELOPT_FP8[algo], "ModelOpt", skip, kv)


@side_file("hf_quant_config.json", computes=("qrt.fp8_linear", "qrt.fp8_static_linear"), name="ModelOpt FP8",
           summary="ModelOpt FP8 per-tensor static or per-channel dynamic, optional FP8 KV cache")
def modelopt_side_file_scheme(path: Path) -> QuantScheme | None:
    side = read_json(path)
    if side.get("producer", {}).get("name") != "modelopt":
        return None
    q = side.get("quantization") or {}
    return _modelopt(q.get("quant_algo"), q.get("kv_cache_quant_algo"), q.get("exclude_modules") or (), path)


@stored_format("modelopt", computes=("qrt.fp8_linear", "qrt.fp8_static_linear"),
               summary="ModelOpt FP8 per-tensor static or per-channel dynamic, optional FP8 KV cache")
def modelopt_scheme(config: dict, config_path) -> QuantScheme:
    kv = config.get("kv_cache_scheme")
    kv_algo = "FP8" if isinstance(kv, dict) and kv.get("type") == "float" and kv.get("num_bits") == 8 else kv
    return _modelopt(config.get("quant_algo"), kv_algo, config.get("ignore") or (), config_path)


def _ct_activation(inputs: dict, config_path) -> str:
    strategy, dynamic = inputs.get("strategy") or "tensor", inputs.get("dynamic")
    if dynamic is True and strategy == "token":
        return DYNAMIC_TOKEN
    if dynamic is False and strategy == "tensor":
        return STATIC_TENSOR
    if dynamic is True and strategy == "group":
        return DYNAMIC_GROUP
    raise UnsupportedError(f"{config_path}: compressed-tensors input activations {inputs} are not supported; "
                           f"supported: dynamic token, static tensor, dynamic group")


@compressed_tensors_format("float-quantized",
                           computes=("qrt.fp8_linear", "qrt.fp8_static_linear", "qrt.fp8_block_linear"),
                           summary="FP8 weights per tensor, channel or block with FP8 "
                           "activations (dynamic per token or group, static per tensor), optional FP8 KV cache",
                           matches=lambda group: group.weights.get("type") == "float"
                           and group.weights.get("num_bits", 8) == 8)  # 4-bit floats: nvfp4.py
def ct_fp8_scheme(group: CompressedTensorsGroup, skip, config_path) -> QuantScheme:
    weights, inputs = group.weights, group.inputs
    if group.fmt != "float-quantized":
        raise UnsupportedError(f"{config_path}: compressed-tensors float weights in format={group.fmt!r} are not "
                               f"supported; supported: 'float-quantized'")
    if weights.get("num_bits") != 8:
        raise UnsupportedError(f"{config_path}: compressed-tensors weights {weights} are not 8-bit float")
    if inputs is None:
        raise UnsupportedError(f"{config_path}: fp8 weights with unquantized activations (W8A16) are not supported yet")
    strategy = weights.get("strategy") or "tensor"
    activation = _ct_activation(inputs, config_path)
    if strategy == "block":
        block = tuple(int(b) for b in weights.get("block_structure") or (128, 128))
        layout = Fp8Storage("block", activation, block)
    elif strategy in ("tensor", "channel"):
        layout = Fp8Storage(strategy, activation)
    else:
        raise UnsupportedError(f"{config_path}: compressed-tensors fp8 weight strategy {strategy!r} is not supported")
    kv = group.config.get("kv_cache_scheme")
    return _fp8_scheme(layout, "compressed-tensors", skip, "compressed-tensors" if kv else None)
