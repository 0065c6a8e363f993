"""NVFP4 checkpoints: compressed-tensors `nvfp4-pack-quantized` (llm-compressor's NVFP4A16 and
NVFP4 schemes), and the linear method ModelOpt's NVFP4 (../modelopt_nvfp4.py) shares.

Tensors per linear (docs/formats.md §15), in nn.Linear orientation:
- the codes, uint8 [N, K / 2]: two FP4 E2M1 codes a byte along K, the even channel in the low nibble
  (compressed-tensors `weight_packed`, ModelOpt `weight`);
- the block scales, float8_e4m3fn [N, K / 16], one per 16 input channels (`weight_scale`);
- a global scale, fp32 [1] or [] per checkpoint module: compressed-tensors' `weight_global_scale`
  divides the block scale (W = e2m1 · e4m3 / global), ModelOpt's `weight_scale_2` multiplies it;
- with FP4 activations, a static activation global scale per module: compressed-tensors'
  `input_global_scale` (a multiplier of the block scales, as the weight's), ModelOpt's
  `input_scale` (its inverse).
The loader pass describes the weights as `Lut4Weights` for `qrt::lut4_linear`; FP4 activations are
rounded by `qrt::nvfp4_round_activations` (kernels/fp4_activations_reference.py) before it.
"""

from dataclasses import dataclass
from functools import partial

import torch

from qrt.kernels.choices import choose
from qrt.kernels.fp4_activations_reference import GROUP
from qrt.kernels.lut4_reference import Lut4Weights, decode_scales, e2m1_table, unpack_nibbles

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.int_weights import copy_ints, remove_parameters, shard_slot
from qrt.formats.registry import CompressedTensorsGroup, compressed_tensors_format
from qrt.formats.scheme import QuantScheme
from qrt.layers.linear import LinearMethod, install_packed, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT, WHOLE


@dataclass(frozen=True)
class Nvfp4Tensors:
    """How one producer names and scales its NVFP4 tensors."""

    producer: str  # for descriptions and errors
    codes: str  # uint8 [N, K / 2]
    block_scales: str  # float8_e4m3fn [N, K / 16]
    weight_global: str  # fp32 per module
    global_divides: bool  # W = e2m1 · block / global (compressed-tensors), else · global (ModelOpt)
    input_global: str | None  # the activations' static global scale; None: activations stay unrounded
    input_global_inverted: bool = False  # the file holds 1 / global (ModelOpt's input_scale)

    def describe(self) -> str:
        activations = "A16" if self.input_global is None else " (FP4 activations)"
        return f"NVFP4{activations} ({self.producer})"


def _load_e4m3_bits(param, loaded, shard_id, *, layout):
    """float8_e4m3fn block scales, kept as their bits (uint8), in the shard's rows."""
    if loaded.dtype != torch.float8_e4m3fn:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected float8_e4m3fn block scales")
    copy_ints(param, loaded.view(torch.uint8), shard_id, layout=layout, dtype=torch.uint8)


def _load_scalar(param, loaded, shard_id, *, layer):
    """A per-module fp32 scale ([] or [1]) into its shard's slot."""
    if loaded.dtype != torch.float32:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected a float32 global scale")
    if loaded.numel() != 1:
        raise TensorMismatch(f"shape {list(loaded.shape)}, expected a per-tensor scale ([] or [1])")
    value = loaded.reshape(())
    if not torch.isfinite(value) or value <= 0:
        raise TensorMismatch(f"holds {float(value)}; a global scale must be a positive finite number")
    param.data[shard_slot(layer, shard_id)] = value


class Nvfp4LinearMethod(LinearMethod):
    name = "nvfp4"

    def __init__(self, tensors: Nvfp4Tensors, module_names=()):
        super().__init__(tensors, module_names)
        # Column splits keep whole bytes and whole groups of 16 (axis_cut checks both); a global
        # scale goes whole to every rank.
        self.shard_rule = {tensors.codes: DENSE_WEIGHT, tensors.block_scales: DENSE_WEIGHT,
                           tensors.weight_global: WHOLE}
        if tensors.input_global is not None:
            self.shard_rule[tensors.input_global] = WHOLE

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        names, n, k = self.cfg, layer.output_size, layer.input_size
        if k % GROUP:
            raise UnsupportedError(f"{self.module_names[0]}: NVFP4 needs input channels in whole groups of {GROUP}; "
                                   f"this layer has {k}")
        shards = layer.shard_layout
        slots = 1 if shards is None else len(shards.shard_ids)
        common = dict(quant_format=self.name)
        setattr(layer, names.codes, make_parameter(
            torch.empty(n, k // 2, dtype=torch.uint8),  # [N, K / 2]: two E2M1 codes a byte, low nibble first
            weight_loader=partial(copy_ints, layout=shards, dtype=torch.uint8), input_dim=1, output_dim=0,
            packed_dim=1, packed_factor=2, **common))
        setattr(layer, names.block_scales, make_parameter(
            torch.empty(n, k // GROUP, dtype=torch.uint8),  # [N, K / 16]: e4m3 bits
            weight_loader=partial(_load_e4m3_bits, layout=shards), input_dim=1, output_dim=0, group_size=GROUP,
            **common))
        setattr(layer, names.weight_global, make_parameter(
            torch.empty(slots, dtype=torch.float32),  # [shards]: each checkpoint module's global scale
            weight_loader=partial(_load_scalar, layer=layer), **common))
        if names.input_global is not None:
            setattr(layer, names.input_global, make_parameter(
                torch.empty(slots, dtype=torch.float32),  # [shards], one activation global for all by the loader pass
                weight_loader=partial(_load_scalar, layer=layer), **common))

    def process_after_loading(self, layer, device: torch.device) -> None:
        names = self.cfg
        weights = self._lut4_weights(layer)
        kernel = choose("qrt.lut4_linear", device.type, weights=weights, dtype=layer.params_dtype)
        if names.input_global is not None:
            # Under a name of qrt's own: the value is the multiplier, whichever way the file held it.
            layer.activation_global = make_parameter(self._activation_global(layer), quant_format=self.name)
            remove_parameters(layer, names.input_global)
        remove_parameters(layer, names.codes, names.block_scales, names.weight_global)
        install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op, quant_format=self.name,
                       note=names.describe())
        self.layout = kernel.layout

    def _lut4_weights(self, layer) -> Lut4Weights:
        names = self.cfg
        codes = unpack_nibbles(getattr(layer, names.codes).data)  # [N, K]
        scales = getattr(layer, names.block_scales).data  # [N, K / 16] e4m3 bits
        globals_ = getattr(layer, names.weight_global).data  # [shards]
        if bool((globals_ == globals_[0]).all()):
            return Lut4Weights(codes, e2m1_table(), GROUP, scales, "e4m3", globals_[0].clone(), names.global_divides)
        # Fused shards with global scales of their own: each row's block scales in fp32, computed
        # as the producer computes them (the same single fp32 product or quotient), so the weight
        # is still exactly the checkpoint's, at 2 more bits a weight.
        rows = self._rows_of_shards(layer, globals_)[:, None]  # [N, 1]
        decoded = decode_scales(scales, "e4m3")
        block = decoded / rows if names.global_divides else decoded * rows
        return Lut4Weights(codes, e2m1_table(), GROUP, block.contiguous(), "fp32")

    @staticmethod
    def _rows_of_shards(layer, per_shard: torch.Tensor) -> torch.Tensor:
        """[shards] -> [N]: each shard's value repeated over its rows."""
        sizes = torch.tensor(layer.shard_layout.sizes)
        return per_shard.repeat_interleave(sizes)

    def _activation_global(self, layer) -> torch.Tensor:
        """fp32 [1]: the multiplier the activations' block scales are found under. The activations of
        a fused layer are rounded once for all its shards, so their scales must agree."""
        names = self.cfg
        loaded = getattr(layer, names.input_global).data  # [shards]
        if not bool((loaded == loaded[0]).all()):
            raise UnsupportedError(f"{', '.join(self.module_names)}: the fused modules' {names.input_global} differ "
                                   f"({loaded.tolist()}); {names.producer} NVFP4 activations are rounded once for "
                                   f"all of them, so qrt needs one value")
        value = loaded[:1].clone()  # [1]
        return 1.0 / value if names.input_global_inverted else value

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.input_global is not None:
            x = torch.ops.qrt.nvfp4_round_activations(x, layer.activation_global)
        return self.layout.linear(layer, x)


_CT_TENSORS = Nvfp4Tensors("compressed-tensors", "weight_packed", "weight_scale", "weight_global_scale",
                           global_divides=True, input_global=None)


def _check_fp4_args(args: dict, what: str, source) -> None:
    """The QuantizationArgs of NVFP4 weights or activations: 4-bit float, symmetric, a tensor_group
    strategy in groups of 16 (a global scale over e4m3 block scales)."""
    wanted = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP, "symmetric": True}
    found = {key: args.get(key, True if key == "symmetric" else None) for key in wanted}
    if found != wanted:
        raise UnsupportedError(f"{source}: compressed-tensors format 'nvfp4-pack-quantized' with {what} {found} is not "
                               f"supported; supported: {wanted}")
    scale_dtype = args.get("scale_dtype")
    if scale_dtype not in (None, "torch.float8_e4m3fn", "float8_e4m3fn"):
        raise UnsupportedError(f"{source}: compressed-tensors format 'nvfp4-pack-quantized' with {what} scale_dtype "
                               f"{scale_dtype!r}; supported: float8_e4m3fn")


@compressed_tensors_format("nvfp4-pack-quantized", computes=("qrt.lut4_linear",),
                           summary="NVFP4: FP4 E2M1 weights, an E4M3 scale per 16 input "
                           "channels over an fp32 global scale; activations unquantized (NVFP4A16) or FP4 per group "
                           "of 16 under a static global scale (NVFP4)",
                           matches=lambda g: g.fmt == "nvfp4-pack-quantized" and g.weights.get("type") == "float"
                           and g.weights.get("num_bits") == 4)
def ct_nvfp4_scheme(group: CompressedTensorsGroup, skip, source) -> QuantScheme:
    _check_fp4_args(group.weights, "weights", source)
    tensors = _CT_TENSORS
    if group.inputs is not None:
        _check_fp4_args(group.inputs, "input activations", source)
        if group.inputs.get("dynamic") != "local":
            # "local": block scales at run time under a calibrated global; fully dynamic or static
            # block scales would need the global, or every scale, from somewhere else.
            raise UnsupportedError(f"{source}: compressed-tensors NVFP4 input activations with dynamic="
                                   f"{group.inputs.get('dynamic')!r} are not supported; supported: 'local' (a static "
                                   f"input_global_scale)")
        tensors = Nvfp4Tensors("compressed-tensors", "weight_packed", "weight_scale", "weight_global_scale",
                               global_divides=True, input_global="input_global_scale")
    return QuantScheme("compressed-tensors", lambda names: Nvfp4LinearMethod(tensors, names), skip,
                       f"compressed-tensors {tensors.describe()}")
