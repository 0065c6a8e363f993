"""compressed-tensors W8A8 int8 checkpoints (`int-quantized`, llm-compressor's W8A8 schemes):
int8 weights per output channel or per tensor, int8 activations dynamic per token or static per
tensor, symmetric or asymmetric (docs/formats.md §3.4 and §3.6).

Tensors per linear, in nn.Linear orientation:
- `weight`: int8 [N, K], symmetric (weight zero points are refused, as every W8A8 runtime does);
- `weight_scale`: bf16/fp16/fp32, [N, 1] per channel, or [1] per tensor (one per fused shard);
- static activations: `input_scale` [1], and when asymmetric `input_zero_point` int8 [1].

Fused q/k/v and gate/up shards each bring their own per-tensor weight scale, written into the
shard's rows of a per-channel scale vector, so no weight is requantized. One activation feeds
every shard, so their static input quantizations must become one: shards calibrated on the same
input (the normal case) agree and are kept as they are; otherwise the union of their ranges gets
one scale and zero point, which represents every shard's range.
"""

from dataclasses import dataclass
from functools import partial

import torch

import qrt.kernels  # noqa: F401  (registers torch.ops.qrt.*)
from qrt.kernels.choices import choose
from qrt.kernels.int8_reference import INT8_MAX, INT8_MIN, Int8Weights, weight_row_sums

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.int_weights import copy_ints, shard_slot
from qrt.layers.linear import LinearMethod, check_shape, install_packed, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT, OUTPUT_VECTOR, WHOLE
from qrt.formats.scheme import QuantScheme
from qrt.formats.registry import CompressedTensorsGroup, compressed_tensors_format

DYNAMIC, STATIC = "dynamic per token", "static per tensor"


@dataclass(frozen=True)
class CtW8A8Config:
    weight_strategy: str  # "channel" | "tensor"
    activation: str  # DYNAMIC | STATIC
    symmetric_activations: bool
    source: str = "config.json"

    def describe(self) -> str:
        sym = "symmetric" if self.symmetric_activations else "asymmetric"
        return (f"compressed-tensors W8A8 int8 ({self.weight_strategy} weight scales, {self.activation} "
                f"{sym} activations)")


def check_scale(loaded: torch.Tensor) -> None:
    if not loaded.dtype.is_floating_point or loaded.dtype.itemsize == 1:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected a float32/bf16/fp16 scale")
    values = loaded.float()
    if not torch.isfinite(values).all() or (values <= 0).any():
        raise TensorMismatch("scale holds non-finite, zero or negative values; a scale must be a positive finite "
                             "multiplier")


def _load_weight_scale(param, loaded, shard_id, *, layer, strategy: str):
    """[n, 1] per channel, or one value ([1] or []) per tensor written into the shard's rows."""
    check_scale(loaded)
    rows = param.data if layer.shard_layout is None else layer.shard_layout.rows(param.data, shard_id)
    if strategy == "tensor":
        if loaded.numel() != 1:
            raise TensorMismatch(f"shape {list(loaded.shape)}, expected one per-tensor scale ([1]) as the "
                                 f"config's weight strategy 'tensor' says")
        rows.fill_(float(loaded.reshape(())))
    else:
        check_shape(loaded, (rows.shape[0], 1), "per-channel weight_scale")
        rows.copy_(loaded.reshape(-1))


def _load_input_scale(param, loaded, shard_id, *, layer):
    check_scale(loaded)
    if loaded.numel() != 1:
        raise TensorMismatch(f"shape {list(loaded.shape)}, expected a per-tensor input scale ([1] or [])")
    param.data[shard_slot(layer, shard_id)] = float(loaded.reshape(()))


def _load_input_zero_point(param, loaded, shard_id, *, layer):
    if loaded.dtype not in (torch.int8, torch.int32) or loaded.numel() != 1:
        raise TensorMismatch(f"dtype {loaded.dtype}, shape {list(loaded.shape)}; expected one int8 zero point ([1])")
    value = int(loaded.reshape(()))
    if not INT8_MIN <= value <= INT8_MAX:
        raise TensorMismatch(f"zero point {value} is outside the int8 range")
    param.data[shard_slot(layer, shard_id)] = value


def merge_static_inputs(scales: torch.Tensor, zeros: torch.Tensor | None):
    """One static quantization for activations that feed several shards.

    scales: fp32 [S]; zeros: int32 [S] or None (symmetric). Returns (scale [1] fp32, zero [1]
    int32 or None). Shards that agree are kept exactly; otherwise the result's range, from
    scale * (-128 - zero) to scale * (127 - zero), covers every shard's."""
    same_zeros = zeros is None or bool((zeros == zeros[0]).all())
    if bool((scales == scales[0]).all()) and same_zeros:
        return scales[:1].clone(), None if zeros is None else zeros[:1].clone()
    if zeros is None:
        return scales.max().reshape(1), None  # symmetric ranges are nested: the largest covers all
    low = (scales * (INT8_MIN - zeros.float())).min()
    high = (scales * (INT8_MAX - zeros.float())).max()
    scale = (high - low) / (INT8_MAX - INT8_MIN)
    zero = (INT8_MIN - low / scale).round().clamp(INT8_MIN, INT8_MAX)
    return scale.reshape(1), zero.to(torch.int32).reshape(1)


class CtW8A8LinearMethod(LinearMethod):
    name = "ct-w8a8"

    def tensor_split(self, layer, param_name: str):
        # Static input scales and zero points are per tensor; the zero-point correction is derived
        # by the loader pass from each rank's own weight rows and K slice, so the ranks' partial
        # outputs sum to the correction of the whole layer.
        scale = WHOLE if self.cfg.weight_strategy == "tensor" else OUTPUT_VECTOR
        return {"weight": DENSE_WEIGHT, "weight_scale": scale, "input_scale": WHOLE, "input_zero_point": WHOLE}.get(param_name)

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        cfg, n, k = self.cfg, layer.output_size, layer.input_size
        shards = layer.shard_layout
        slots = 1 if shards is None else len(shards.shard_ids)
        common = dict(quant_format=self.name)
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=torch.int8),  # [N, K] signed
            weight_loader=partial(copy_ints, layout=shards, dtype=torch.int8), input_dim=1, output_dim=0, **common,
        )
        layer.weight_scale = make_parameter(
            torch.empty(n, dtype=torch.float32),  # [N]: per-tensor scales fill their shard's rows
            weight_loader=partial(_load_weight_scale, layer=layer, strategy=cfg.weight_strategy), output_dim=0,
            **common,
        )
        layer.register_parameter("input_scale", None)
        layer.register_parameter("input_zero_point", None)
        if cfg.activation == STATIC:
            layer.input_scale = make_parameter(
                torch.empty(slots, dtype=torch.float32),  # [shards], merged to [1] by the loader pass
                weight_loader=partial(_load_input_scale, layer=layer), **common,
            )
            if not cfg.symmetric_activations:
                layer.input_zero_point = make_parameter(
                    torch.empty(slots, dtype=torch.int32),  # [shards], merged to [1] by the loader pass
                    weight_loader=partial(_load_input_zero_point, layer=layer), **common,
                )

    def process_after_loading(self, layer, device: torch.device) -> None:
        if layer.input_scale is not None:
            zeros = None if layer.input_zero_point is None else layer.input_zero_point.data
            scale, zero = merge_static_inputs(layer.input_scale.data, zeros)
            layer.input_scale = make_parameter(scale)  # [1] fp32
            layer.input_zero_point = None if zero is None else make_parameter(zero)  # [1] int32
        # The zero-point correction's weight factor (see kernels/int8_reference.py).
        sums = None if self.cfg.symmetric_activations else make_parameter(weight_row_sums(layer.weight.data))
        layer.register_parameter("weight_sums", sums)  # [N] int32 or None
        weights = Int8Weights(layer.weight.data, layer.weight_scale.data, _data(layer.input_scale),
                              _data(layer.input_zero_point), _data(layer.weight_sums))
        self.layout = install_int8_weights(layer, weights, device, self.cfg.describe())

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x)


def _data(param):
    return None if param is None else param.data


def install_int8_weights(layer, weights, device: torch.device, what: str, logical: str = "qrt.int8_linear"):
    """Pack a W8A8 layer's weights (`Int8Weights`, or a form that gives them) for the device's
    kernel of `logical` (QQQ's 4-bit layers run as int8 on the CPU) and record it; returns the
    layout, whose `linear(layer, x)` runs the layer from then on."""
    kernel = choose(logical, device.type)
    install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op, what)
    return kernel.layout


def ct_w8a8_config(fmt: str, weights: dict, inputs: dict, source) -> CtW8A8Config:
    """CtW8A8Config for a config group with int weights and quantized input activations."""
    if fmt not in ("int-quantized", "naive-quantized"):
        raise UnsupportedError(f"{source}: compressed-tensors format {fmt!r} with int weights and quantized "
                               f"activations is not supported; supported: int-quantized")
    if weights.get("num_bits") != 8 or inputs.get("type") != "int" or inputs.get("num_bits") != 8:
        raise UnsupportedError(f"{source}: compressed-tensors weights {weights} with input activations {inputs} are "
                               f"not supported; qrt runs int8 weights with int8 activations (W8A8)")
    group_size = weights.get("group_size")
    strategy = weights.get("strategy") or ("tensor" if group_size is None else "channel" if group_size == -1
                                           else "group")
    if strategy not in ("channel", "tensor"):
        raise UnsupportedError(f"{source}: compressed-tensors W8A8 weight strategy {strategy!r} is not supported; "
                               f"supported: channel, tensor")
    if not weights.get("symmetric", True):
        raise UnsupportedError(f"{source}: compressed-tensors W8A8 with asymmetric weights (weight_zero_point) is "
                               f"not supported; int8 weights must be symmetric (activations may be asymmetric)")
    dynamic, input_strategy = inputs.get("dynamic"), inputs.get("strategy") or "tensor"
    if dynamic is True and input_strategy == "token":
        activation = DYNAMIC
    elif dynamic is False and input_strategy == "tensor":
        activation = STATIC
    else:
        raise UnsupportedError(f"{source}: compressed-tensors int8 input activations with dynamic={dynamic!r}, "
                               f"strategy={input_strategy!r} are not supported; supported: dynamic per token, "
                               f"static per tensor")
    return CtW8A8Config(strategy, activation, bool(inputs.get("symmetric", True)), str(source))


@compressed_tensors_format("int W8A8", computes=("qrt.int8_linear",),
                           summary="int8 weights per channel or tensor, int8 activations dynamic per "
                           "token or static per tensor, symmetric or asymmetric",
                           matches=lambda g: g.fmt != "marlin-24" and g.weights.get("type") == "int"
                           and g.inputs is not None)
def ct_w8a8_scheme(group: CompressedTensorsGroup, skip, source) -> QuantScheme:
    cfg = ct_w8a8_config(group.fmt, group.weights, group.inputs, source)
    return QuantScheme("compressed-tensors", lambda names: CtW8A8LinearMethod(cfg, names), skip, cfg.describe())
