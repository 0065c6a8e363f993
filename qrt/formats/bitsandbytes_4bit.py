"""bitsandbytes 4-bit weights (NF4 or FP4 codes, a block scale per `blocksize` weights), as
transformers saves a `Linear4bit` (docs/formats.md §14).

Tensors per linear, P the module's prefix:
- `P.weight` uint8 [N·K/2, 1]: the weight [N, K] flattened row-major, two codes a byte, the even
  element in the high nibble;
- `P.weight.absmax`: one scale per block of `blocksize` elements of the flattened weight, fp32
  [N·K/G]; with double quantization uint8 codes into `P.weight.nested_quant_map` (fp32 [256]),
  times `P.weight.nested_absmax` (fp32, one per `nested_blocksize` blocks), plus `nested_offset`;
- `P.weight.quant_map` fp32 [16]: the code table;
- `P.weight.quant_state.bitsandbytes__<nf4|fp4>`: uint8 bytes of a JSON object with quant_type,
  blocksize, dtype, shape and the nested_* values.
W[n, k] = quant_map[q] · absmax[(n·K + k) // G]: blocks run along the flattened weight, so they
are blocks of rows only when G divides K. Otherwise a block crosses from one row into the next; qrt
then gives the layer groups of gcd(K, G) channels, each inside one block and holding its scale,
which is exact at the cost of more scales. The loader pass describes the layer as `Lut4Weights`
for `qrt::lut4_linear`, with the absmax decoded to fp32 scales per group.
"""

import json
import math
from functools import partial

import torch

from qrt.kernels.choices import choose
from qrt.kernels.lut4_reference import Lut4Weights

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.int_weights import remove_parameters
from qrt.layers.linear import LinearMethod, check_shape, install_packed, make_parameter
from qrt.layers.tensor_parallel import (WHOLE, TensorSplit, largest_tp, rank_columns, stored_entries,
                                        zero_padded)

# NF4 (QLoRA): quantiles of the standard normal distribution scaled to [-1, 1], code 7 exactly 0.
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def fp4_value(code: int) -> float:
    """bitsandbytes' FP4 before scaling: bit 3 the sign, bits 2-1 an exponent e, bit 0 a mantissa m;
    (1 + m / 2) · 2 ** (4 - e) for e > 0 and m / 16 for e = 0 (so 0, 0.0625, 8, 12, 4, 6, 2, 3)."""
    e, m = (code >> 1) & 3, code & 1
    magnitude = (1 + m / 2) * 2.0 ** (4 - e) if e else m / 16
    return -magnitude if code & 8 else magnitude


def code_table(quant_type: str) -> torch.Tensor:
    """fp32 [16]: the values bitsandbytes' dequantizer gives each code, the table divided in fp32 by
    its largest magnitude (FP4: 12)."""
    values = NF4_VALUES if quant_type == "nf4" else tuple(fp4_value(c) for c in range(16))
    table = torch.tensor(values, dtype=torch.float32)  # [16]
    return table / table.abs().max()


# bitsandbytes counts two quant_states equal when their tables agree to this (QuantState.__eq__).
_TABLE_TOLERANCE = 1e-6
_STATE_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state")


def unpack_high_first(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [R, K / 2], element 2i in the high nibble of byte i -> uint8 codes [R, K]."""
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(packed.shape[0], k)


class Bnb4bitLinearMethod(LinearMethod):
    # The codes follow the output rows (K / 2 bytes a row); a row-parallel rank reads whole rows
    # and keeps its bytes. The quant_state runs along the flattened weight, and its nested blocks
    # cross rows, so every rank reads it whole and keeps its blocks once decoded.
    shard_rule = {"weight": TensorSplit(n_dim=0, k_dim=None), **{f"weight_{part}": WHOLE for part in _STATE_PARTS}}

    def __init__(self, cfg, module_names=()):
        super().__init__(cfg, module_names)
        self.name = f"bitsandbytes-{cfg.quant_type}"
        self.parts = _STATE_PARTS if cfg.double_quant else ("absmax", "quant_map", "quant_state")
        self.checkpoint_leaves = {f"weight.{part}": f"weight_{part}" for part in self.parts if part != "quant_state"}
        # The JSON tensor is named by its quant type: the other type's is an unexpected tensor.
        self.checkpoint_leaves[f"weight.quant_state.bitsandbytes__{cfg.quant_type}"] = "weight_quant_state"

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k, full_k = layer.output_size, layer.input_size, layer.full_input_size
        if full_k % 2:
            raise UnsupportedError(f"{self.module_names[0]}: bitsandbytes 4-bit packs two codes a byte along the "
                                   f"flattened weight; {full_k} input channels put a row's last code in the next "
                                   f"row's byte, which qrt does not read")
        layer.weight = make_parameter(
            torch.empty(n, k // 2, dtype=torch.uint8),  # [N, K / 2], two codes a byte, high nibble first
            weight_loader=partial(_load_codes, layer=layer), output_dim=0, input_dim=1, quant_format=self.name)
        # The quant_state's sizes depend on its blocksize, which only its own JSON records: each
        # part is kept as loaded, per shard, and checked as the parts arrive.
        layer.bnb_state = {}
        for part in self.parts:
            setattr(layer, f"weight_{part}", make_parameter(
                torch.empty(0, dtype=torch.uint8),  # a name to load into; the tensor goes to layer.bnb_state
                weight_loader=partial(_keep_state_part, layer=layer, method=self, part=part), quant_format=self.name))

    def process_after_loading(self, layer, device: torch.device) -> None:
        shard_ids = (None,) if layer.shard_layout is None else layer.shard_layout.shard_ids
        blocks = [self._rank_blocks(layer, slot, layer.bnb_state[shard_id]) for slot, shard_id in enumerate(shard_ids)]
        group_size = blocks[0][1]
        if any(g != group_size for _, g in blocks):
            raise UnsupportedError(f"{self.module_names}: the fused shards have different blocksizes "
                                   f"{[g for _, g in blocks]}; qrt runs them as one matmul with one")
        scales = torch.cat([s for s, _ in blocks])  # [N, K / G] fp32
        codes = unpack_high_first(layer.weight.data, layer.input_size)  # [N, K]
        weights = Lut4Weights(codes, code_table(self.cfg.quant_type), group_size, scales, "fp32")
        kernel = choose("qrt.lut4_linear", device.type, weights=weights, dtype=layer.params_dtype)
        remove_parameters(layer, *(f"weight_{part}" for part in self.parts))
        del layer.bnb_state
        install_packed(layer, kernel.layout.pack(weights, layer.params_dtype), kernel.op, quant_format=self.name)
        self.layout = kernel.layout

    def _rank_blocks(self, layer, slot: int, state: dict) -> tuple[torch.Tensor, int]:
        """fp32 [rows, K / g] scales of this rank's part of one shard, and the group g."""
        header = state["quant_state"]
        rows, full_k = layer.full_shard_sizes[slot], layer.full_input_size
        group = row_group(full_k, header["blocksize"])
        starts = torch.arange(rows * full_k // group) * group  # [N_shard · K_full / g]: each group's first element
        absmax = decoded_absmax(state, header)[starts // header["blocksize"]].view(rows, -1)  # [N_shard, K_full / g]
        if layer.n_slices is not None:
            part = layer.n_slices[slot]  # a padded vocabulary's rows past its end are zeros
            absmax = zero_padded(absmax.narrow(0, part.start, stored_entries(part.start, part.length, rows)),
                                 part.length, 0)
        return rank_columns(layer, absmax, group), group

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x)


def row_group(k: int, blocksize: int) -> int:
    """Input channels per scale: the blocksize where it divides K, else the largest group that
    divides both, so that no group crosses a block's (or a row's) end."""
    return math.gcd(k, blocksize)


def decoded_absmax(state: dict, header: dict) -> torch.Tensor:
    """The fp32 block scales [blocks]: as stored, or double-dequantized as bitsandbytes does it
    (the nested code times its block's nested absmax, in fp32, plus the offset, in fp32)."""
    if "nested_absmax" not in state:
        return state["absmax"].float()
    codes = state["absmax"].long()  # [blocks]
    nested = torch.arange(codes.numel()) // header["nested_blocksize"]  # [blocks]: each code's nested block
    offset = torch.tensor(float(header["nested_offset"]), dtype=torch.float32)
    return state["nested_quant_map"].float()[codes] * state["nested_absmax"].float()[nested] + offset


def _load_codes(param, loaded, shard_id, *, layer):
    """uint8 [rows · K / 2, 1] of this rank's rows -> their bytes of this rank's input channels."""
    if loaded.dtype != torch.uint8:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected uint8 packed 4-bit codes")
    dst = param.data if layer.shard_layout is None else layer.shard_layout.rows(param.data, shard_id)
    row_bytes = layer.full_input_size // 2
    check_shape(loaded, (dst.shape[0] * row_bytes, 1), "packed 4-bit weight")
    dst.copy_(rank_columns(layer, loaded.view(dst.shape[0], row_bytes), 2))


def _keep_state_part(param, loaded, shard_id, *, layer, method, part):
    state = layer.bnb_state.setdefault(shard_id, {})
    state[part] = _parsed_header(loaded) if part == "quant_state" else loaded.clone()
    _check_state(layer, method, shard_id, state)


def _parsed_header(loaded: torch.Tensor) -> dict:
    if loaded.dtype != torch.uint8 or loaded.dim() != 1:
        raise TensorMismatch(f"{loaded.dtype} {list(loaded.shape)}, expected the uint8 bytes of a JSON quant_state")
    try:
        header = json.loads(bytes(loaded.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TensorMismatch(f"is not a JSON quant_state ({err})") from None
    if not isinstance(header, dict):
        raise TensorMismatch(f"holds a JSON {type(header).__name__}, expected an object")
    return header


def _check_state(layer, method, shard_id, state: dict) -> None:
    """Every check the parts of one shard's quant_state that have arrived allow: run after each
    part, so a mismatch is reported with the tensor (and file) that completed it."""
    slot = 0 if layer.shard_layout is None else layer.shard_layout.shard_ids.index(shard_id)
    header = state.get("quant_state")
    if header is not None:
        _check_header(layer, method, slot, header)
    if "quant_map" in state:
        _check_float(state["quant_map"], (16,), "code table")
        table = code_table(method.cfg.quant_type)
        if (state["quant_map"].float() - table).abs().max() > _TABLE_TOLERANCE:
            raise TensorMismatch(f"is not bitsandbytes' {method.cfg.quant_type.upper()} table "
                                 f"(holds {state['quant_map'].tolist()}, expected {table.tolist()})")
    if "nested_quant_map" in state:
        _check_float(state["nested_quant_map"], (256,), "nested code table")
    if header is None:
        return
    blocks = -(-layer.full_shard_sizes[slot] * layer.full_input_size // header["blocksize"])  # the last may be partial
    if "absmax" in state:
        if method.cfg.double_quant:
            if state["absmax"].dtype != torch.uint8:
                raise TensorMismatch(f"dtype {state['absmax'].dtype}, expected uint8 absmax codes (double quant)")
            check_shape(state["absmax"], (blocks,), "absmax")
        else:
            _check_float(state["absmax"], (blocks,), "absmax")
    if "nested_absmax" in state:
        _check_float(state["nested_absmax"], (-(-blocks // header["nested_blocksize"]),), "nested absmax")


def _check_float(tensor: torch.Tensor, shape, what: str) -> None:
    if not tensor.dtype.is_floating_point:
        raise TensorMismatch(f"dtype {tensor.dtype}, expected a float {what}")
    check_shape(tensor, shape, what)


def _check_header(layer, method, slot: int, header: dict) -> None:
    cfg = method.cfg
    if header.get("quant_type") != cfg.quant_type:
        raise TensorMismatch(f"says quant_type {header.get('quant_type')!r}, but the config says {cfg.quant_type!r}")
    expected = [layer.full_shard_sizes[slot], layer.full_input_size]
    if header.get("shape") != expected:
        raise TensorMismatch(f"records the weight's shape as {header.get('shape')}, but the model's layer is "
                             f"{expected}")
    group = header.get("blocksize")
    if not isinstance(group, int) or group <= 0:
        raise TensorMismatch(f"blocksize {group!r}, expected a positive integer")
    unit = row_group(layer.full_input_size, group)
    if layer.k_slice is not None and layer.input_size % unit:
        raise UnsupportedError(f"{method.module_names[slot]}: with tp={layer.parallel.size} a rank holds "
                               f"{layer.input_size} input channels, which split bitsandbytes' blocks of {group} "
                               f"(groups of {unit} in this layer's rows); the largest tp this layer allows is "
                               f"{largest_tp(layer.full_input_size, unit, layer.parallel.size)}")
    if cfg.double_quant:
        nested = header.get("nested_blocksize")
        if not isinstance(nested, int) or nested <= 0 or not isinstance(header.get("nested_offset"), (int, float)):
            raise TensorMismatch(f"nested_blocksize {nested!r} and nested_offset {header.get('nested_offset')!r}, "
                                 f"expected a positive integer and a number (double quant)")
