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

import torch

from qrt.kernels.fp8_block_reference import dequantize_block_fp8
from qrt.kernels.fp8_reference import FP8_DTYPE

from .errors import TensorMismatch, UnsupportedError
from .parameters import make_parameter, replace_parameter
from .shards import ShardLayout, check_shape, copy_rows

# activation schemes
DYNAMIC_TOKEN = "dynamic per token"
STATIC_TENSOR = "static per tensor"
DYNAMIC_GROUP = "dynamic per token-group"


@dataclass(frozen=True)
class Fp8Layout:
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


def _load_block_scale(param, loaded, shard_id, *, layout):
    _check_scale(loaded)
    copy_rows(param, loaded, shard_id, layout=layout)


def _check_scale(loaded):
    if not loaded.dtype.is_floating_point or loaded.dtype == FP8_DTYPE:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected a float32/bf16/fp16 scale")
    values = loaded.float()
    if not torch.isfinite(values).all() or (values <= 0).any():
        raise TensorMismatch(f"scale holds {'non-finite' if not torch.isfinite(values).all() else 'zero or negative'} "
                             f"values; a scale must be a positive finite multiplier")


class Fp8CheckpointLinearMethod:
    name = "fp8"

    def __init__(self, layout: Fp8Layout, family: str):
        self.layout = layout
        self.family = family

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        shards = layer.shard_layout
        spec = self.layout
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=FP8_DTYPE),  # [N, K] e4m3 as stored
            weight_loader=partial(_load_fp8_weight, layout=shards), input_dim=1, output_dim=0, quant_format=self.name,
        )
        if spec.weight == "block":
            scales = torch.empty(math.ceil(n / spec.block[0]), math.ceil(k / spec.block[1]))  # [N/bn, K/bk] fp32
            loader = partial(_load_block_scale, layout=_block_layout(layer, spec.block[0]))
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
        if layer.has_bias:
            layer.bias = make_parameter(torch.empty(n, dtype=dtype), weight_loader=partial(copy_rows, layout=shards),
                                        output_dim=0, quant_format=self.name)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        spec = self.layout
        scale = getattr(layer, spec.scale_name)
        if spec.activation == DYNAMIC_TOKEN:
            return torch.ops.qrt.fp8_linear(x, layer.weight, scale, layer.bias)
        if spec.activation == STATIC_TENSOR:
            return torch.ops.qrt.fp8_static_linear(x, layer.weight, scale, layer.input_scale, layer.bias)
        return torch.ops.qrt.fp8_block_linear(x, layer.weight, scale, layer.bias, spec.block[0], spec.block[1])

    def process_after_loading(self, layer, device: torch.device) -> None:
        spec = self.layout
        if spec.activation == STATIC_TENSOR:
            replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1))  # [1]
        described = f"fp8_e4m3 [N, K], {spec.weight} scales, {spec.activation} activations ({self.family})"
        op = {DYNAMIC_TOKEN: "fp8_linear", STATIC_TENSOR: "fp8_static_linear", DYNAMIC_GROUP: "fp8_block_linear"}
        op = op[spec.activation]
        if device.type == "cuda":
            layer.weight.storage_layout, layer.weight.kernel = described, f"qrt.{op}_triton"
            return
        dtype = layer.params_dtype
        if spec.weight == "block":
            # Block scales vary along K, so they cannot be applied after the GEMM: the CPU kernel
            # takes the dequantized weight (fp8 × block scale, rounded once to the model dtype).
            # The scale grid becomes ones, so the reference op, which multiplies the two, still
            # computes the same weight when a model runs eagerly.
            scales = getattr(layer, spec.scale_name).data
            widened = dequantize_block_fp8(layer.weight.data, scales, spec.block[0], spec.block[1], dtype)
            replace_parameter(layer, spec.scale_name, torch.ones_like(scales))  # [N/bn, K/bk]
            note = "dequantized with block scales"
        else:
            widened = layer.weight.data.to(dtype)  # exact: e4m3 is a subset of bf16
            note = "holding exact fp8 values"
        replace_parameter(layer, "weight", widened, kernel=f"qrt.{op}_cpu",
                          storage_layout=f"{str(dtype).removeprefix('torch.')} [N, K] {note} ({self.family})")


def _block_layout(layer, block_rows: int) -> ShardLayout | None:
    """Shard layout of a block-scale grid: each shard's rows counted in blocks."""
    shards = layer.shard_layout
    if shards is None:
        return None
    sizes = [size for _, size in shards.offsets.values()]
    if any(size % block_rows for size in sizes[:-1]):
        raise UnsupportedError(f"fused shards of sizes {sizes} are not multiples of the {block_rows}-row weight "
                               f"block, so their block scales cannot be stacked")
    return ShardLayout.stacked(shards.shard_ids, [math.ceil(size / block_rows) for size in sizes])
