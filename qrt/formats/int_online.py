"""`quant="int4"` and `quant="int8"`: integer weights quantized from a bf16 checkpoint while it loads.

- int4: asymmetric, round to nearest, groups of 32 input channels (llama.cpp's Q4_0/Q4_1 grouping),
  fractional zero points: code 0 is the group's minimum, as in llama.cpp's Q4_1 and the float zero
  points of ATen's int4 CPU kernel. `quant="int4-g128"` uses groups of 128 (or the largest of 128,
  64, 32 dividing K, so that the CPU kernel can run it): a quarter of the scales, a faster CPU
  decode, and on SmolLM2 about 1.5x the perplexity of groups of 32 (README, "Quality").
- int8: symmetric per output channel, codes in [-127, 127].

Each weight is quantized the moment it streams in and stored packed (int32 words along K), so the
model never holds a layer in both bf16 and int. Scales are rounded to the model dtype before the
codes are computed: the stored scale is then exactly the one the codes were made for, even where
the CPU kernel needs scales in the activations' dtype.
"""

from dataclasses import dataclass
from functools import partial

import torch

from qrt.kernels.int_reference import IntWeights, pack_factor, pack_rows, unpack_rows

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.int_weights import group_count, install_int_weights, remove_parameters
from qrt.layers.tensor_parallel import DENSE_WEIGHT_WHOLE_ROWS, largest_tp, rank_columns
from qrt.kernels.exact_division import divide_exactly
from qrt.layers.linear import LinearMethod, check_shape, make_parameter
from qrt.formats.registry import online_format

_MIN_SCALE = 1e-8  # an all-equal group gets a tiny scale instead of a division by zero
# Rows quantized at a time: the float32 temporaries of a whole 49152-row lm_head came to several
# hundred MiB at once, the peak of the whole load.
_ROWS_PER_CHUNK = 4096


@dataclass(frozen=True)
class OnlineIntConfig:
    bits: int  # 4: asymmetric groups; 8: symmetric channels
    max_group: int = 32  # 4-bit: the largest group size tried

    def group_size(self, k: int) -> int:
        if self.bits == 8:
            return k
        return next((g for g in (128, 64, 32) if g <= self.max_group and k % g == 0), self.max_group)

    def describe(self, k: int) -> str:
        return "int8 channel (online)" if self.bits == 8 else f"int4 g{self.group_size(k)} asymmetric (online)"


def quantize_int_rows(w: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype):
    """Round-to-nearest integer quantization of w [n, K] in groups of `group_size` along K.

    Returns (q [n, K] int32 unsigned, scales [n, groups] scale_dtype, zeros [n, groups] fp32)
    with w ≈ (q - zeros) * scales. 8-bit is symmetric (zero 128); lower widths are asymmetric with
    fractional zero points."""
    n, k = w.shape
    groups = group_count(k, group_size)
    # A float32 copy of its own ([n, groups * G]), which the steps below overwrite in place: loading
    # spends most of its time here, and each full-size temporary costs as much as the arithmetic.
    padded = torch.empty(n, groups * group_size, dtype=torch.float32, device=w.device)
    padded[:, :k].copy_(w)
    grid = padded.view(n, groups, group_size)
    if bits == 8:
        # Padding zeros cannot raise a group's amax, so the partial last group is unaffected.
        padded[:, k:].zero_()
        amax = grid.abs().amax(dim=-1)  # [n, groups]
        scales = divide_exactly(amax, 127.0).clamp(min=_MIN_SCALE).to(scale_dtype)
        zeros = torch.full_like(amax, 128.0)
        q = grid.div_(scales.float()[..., None]).round_().clamp_(-127, 127).add_(128)
    else:
        maxq = 2**bits - 1
        # Pad with each row's last value, which lies in the partial group: padding never widens its range.
        padded[:, k:].copy_(padded[:, k - 1:k].expand(n, groups * group_size - k))
        low, high = grid.amin(dim=-1), grid.amax(dim=-1)  # [n, groups]
        scales = divide_exactly(high - low, maxq).clamp(min=_MIN_SCALE).to(scale_dtype)
        # A fractional zero point puts code 0 exactly on the group's minimum (W = q * s + min): both
        # ends of the range are used, where an integer zero wastes up to half a step at each end.
        zeros = -low / scales.float()
        q = grid.div_(scales.float()[..., None]).add_(zeros[..., None]).round_().clamp_(0, maxq)
    return q.view(n, -1)[:, :k].to(torch.int32), scales, zeros


def _quantize_into(param, loaded: torch.Tensor, shard_id, *, layer, method):
    """weight_loader: quantize a float shard [n, K] into its columns of the packed weight. A
    row-parallel rank quantizes whole rows, as one rank would, and keeps its input channels."""
    if not loaded.dtype.is_floating_point or loaded.dtype.itemsize == 1:
        raise TensorMismatch(f"dtype {loaded.dtype}, expected a bf16/fp16/fp32 weight to quantize")
    shards, cfg = layer.shard_layout, method.cfg
    columns = param.data if shards is None else shards.rows(param.data, shard_id, dim=1)
    check_shape(loaded, (columns.shape[1], layer.full_input_size))
    group = cfg.group_size(layer.full_input_size)
    per_channel = group == layer.full_input_size  # one scale per row: every rank keeps it whole
    targets = {name: getattr(layer, name).data for name in ("scales", "zeros")}
    if shards is not None:
        targets = {name: shards.rows(target, shard_id, dim=1) for name, target in targets.items()}
    for start in range(0, loaded.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        q, scales, zeros = quantize_int_rows(loaded[rows], cfg.bits, group, layer.params_dtype)
        if not per_channel:
            scales, zeros = rank_columns(layer, scales, group), rank_columns(layer, zeros, group)
        columns[:, rows].copy_(pack_rows(rank_columns(layer, q).t(), cfg.bits))
        targets["scales"][:, rows].copy_(scales.t())
        targets["zeros"][:, rows].copy_(zeros.t())


class OnlineIntLinearMethod(LinearMethod):
    # The bf16 weight it quantizes as it streams in, whole rows on every rank (see _quantize_into).
    shard_rule = {"weight": DENSE_WEIGHT_WHOLE_ROWS}

    def __init__(self, bits: int, max_group: int = 32, module_names=()):
        super().__init__(OnlineIntConfig(bits, max_group), module_names)
        self.name = f"int{bits}"

    def group_size(self, layer) -> int:
        """The group of this rank's layout: the whole layer's (chosen from its K), or this rank's K
        for one group per channel."""
        group = self.cfg.group_size(layer.full_input_size)
        return layer.input_size if group == layer.full_input_size else group

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k, bits = layer.output_size, layer.input_size, self.cfg.bits
        group = self.group_size(layer)
        if k % group:
            raise UnsupportedError(f"{self.module_names[0]}: {k} input channels per rank do not hold whole "
                                   f"{self.name} groups of {group}; the largest tp this layer allows is "
                                   f"{largest_tp(layer.full_input_size, group, layer.parallel.size)}")
        groups = group_count(k, group)
        # Filled by the weight's loader, never read from the checkpoint: no weight_loader.
        layer.scales = make_parameter(torch.empty(groups, n, dtype=dtype), quant_format=self.name)  # [groups, N]
        layer.zeros = make_parameter(torch.empty(groups, n, dtype=torch.float32), quant_format=self.name)
        layer.weight = make_parameter(
            torch.empty(-(-k // pack_factor(bits)), n, dtype=torch.int32),  # [ceil(K / pf), N] along K
            weight_loader=partial(_quantize_into, layer=layer, method=self), loaded_shape=(n, layer.full_input_size),
            input_dim=0, output_dim=1, packed_dim=0, packed_factor=pack_factor(bits), quant_format=self.name,
        )

    def process_after_loading(self, layer, device: torch.device) -> None:
        k, bits = layer.input_size, self.cfg.bits
        # Unpacked to bytes (the codes are below 256): int32 would be 4x the weight's size at once.
        weights = IntWeights(unpack_rows(layer.weight.data, bits, k, torch.uint8), layer.scales.data, layer.zeros.data, bits,
                             self.group_size(layer))
        remove_parameters(layer, "weight", "scales", "zeros")
        self.layout = install_int_weights(layer, weights, device, self.cfg.describe(layer.full_input_size))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.layout.linear(layer, x, self.cfg.bits, self.group_size(layer))


# Weight-only integer formats also quantize lm_head, to int8 per channel: with 4-bit layers, a bf16
# lm_head is about half the bytes read per decoded token (SmolLM2: 57 of ~130 MB), and int8 costs
# it +0.3% perplexity there. The embeddings stay as stored (a lookup reads one row per token).
def _int8_lm_head() -> OnlineIntLinearMethod:
    return OnlineIntLinearMethod(8, module_names=["lm_head"])


INT8_LM_HEAD = dict(lm_head=_int8_lm_head, lm_head_summary="lm_head int8 per channel")


@online_format("int4", computes=("qrt.int_linear",),
               summary="4-bit weights, asymmetric groups of 32, bf16 activations", **INT8_LM_HEAD)
def int4_online_method(module_names) -> OnlineIntLinearMethod:
    return OnlineIntLinearMethod(4, max_group=32, module_names=module_names)


@online_format("int4-g128", computes=("qrt.int_linear",),
               summary="4-bit weights, asymmetric groups of 128 (64 or 32 where 128 does not divide K), "
               "bf16 activations", **INT8_LM_HEAD)
def int4_g128_online_method(module_names) -> OnlineIntLinearMethod:
    return OnlineIntLinearMethod(4, max_group=128, module_names=module_names)


@online_format("int8", computes=("qrt.int_linear",),
               summary="8-bit weights per channel, bf16 activations", **INT8_LM_HEAD)
def int8_online_method(module_names) -> OnlineIntLinearMethod:
    return OnlineIntLinearMethod(8, module_names=module_names)
