"""GPTQ checkpoints (AutoGPTQ, GPTQModel, transformers/optimum exports), 2/4/8-bit.

Tensors per linear (docs/formats.md §1): `qweight` int32 [K / pf, N] packed along K, `qzeros` int32
[groups, N / pf] packed along N, `scales` [groups, N], `g_idx` int32 [K] (act-order), all
LSB-first. W[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g = g_idx[k].

Zero points: v1 files (`checkpoint_format: gptq`, the default) store z - 1, v2 files store z.
v1 is read by adding 1 to every field with one word-wide addition (0x11111111 for 4-bit). That
is what GPTQModel's exporter subtracted, borrows included, so asymmetric files whose zero was 0
come back exactly; for every other file it equals adding 1 per field.
"""

import re
from dataclasses import dataclass, replace
from functools import partial

import torch

from qrt.kernels.int_reference import IntWeights, SUPPORTED_BITS, pack_factor, unpack_rows

from qrt.errors import ConfigError, UnsupportedError
from qrt.formats.int_weights import (copy_ints, g_idx_parameter, group_count, install_int_weights,
                                     groups_split_along_k, loaded_g_idx, rank_group_indices, remove_parameters,
                                     scaled_shards)
from qrt.layers.linear import LinearMethod, copy_rows, make_parameter
from qrt.layers.tensor_parallel import TensorSplit
from qrt.formats.scheme import QuantScheme
from qrt.formats.registry import stored_format

_CHECKPOINT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GptqConfig:
    bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool
    sym: bool
    v2: bool  # zero points stored as they are (GPTQModel's gptq_v2)
    source: str = "config.json"

    def describe(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        extra = (", act-order" if self.desc_act else "") + ("" if self.sym else ", asymmetric")
        return f"GPTQ{' v2' if self.v2 else ''} {self.bits}-bit {group}{extra}"


def gptq_zero_points(qzeros: torch.Tensor, bits: int, n: int, v2: bool) -> torch.Tensor:
    """int32 [groups, N / pf] as stored -> the true zero points, int32 [groups, N]."""
    words = qzeros
    if not v2:
        # A 1 in every field (0x11111111 for 4-bit), added word-wide, modulo 2**32.
        increment = sum(1 << (bits * i) for i in range(32 // bits))
        words = (words.to(torch.int64) + increment) & 0xFFFFFFFF
    return unpack_rows(words.t().contiguous(), bits, n).t()


class GptqLinearMethod(LinearMethod):
    name = "gptq"

    def tensor_split(self, layer, param_name: str):
        # Group scales and zeros split along K with the channels unless every rank holds all groups
        # (groups_split_along_k); the loader pass then keeps those its channels use.
        grouped_k = 0 if groups_split_along_k(layer, self.cfg.group_size, self.cfg.desc_act) else None
        return {"qweight": TensorSplit(1, 0), "qzeros": TensorSplit(1, grouped_k), "scales": TensorSplit(1, grouped_k),
                "g_idx": TensorSplit(None, 0)}.get(param_name)

    def _whole_groups(self, layer) -> bool:
        return self.cfg.desc_act and layer.splits_input

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        cfg, n, k = self.cfg, layer.output_size, layer.input_size
        pf = pack_factor(cfg.bits)
        group = k if cfg.group_size == -1 else cfg.group_size
        groups = group_count(layer.full_input_size if self._whole_groups(layer) else k, group)
        if k % pf:
            raise UnsupportedError(f"{self.module_names[0]}: {k} input channels do not fill whole int32 words of "
                                   f"{pf} {cfg.bits}-bit values")
        shards = layer.shard_layout
        common = dict(quant_format=self.name)
        layer.qweight = make_parameter(
            torch.empty(k // pf, n, dtype=torch.int32),  # [K / pf, N], pf values along K per word
            weight_loader=partial(copy_ints, layout=shards, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=0, packed_factor=pf, **common,
        )
        if n % pf:
            raise UnsupportedError(f"{self.module_names[0]}: {n} output channels do not fill whole int32 words of "
                                   f"{pf} zero points")
        layer.qzeros = make_parameter(
            torch.empty(groups, n // pf, dtype=torch.int32),  # [groups, N / pf], pf zero points along N per word
            weight_loader=partial(copy_ints, layout=scaled_shards(layer, pf, "GPTQ qzeros"), dtype=torch.int32),
            output_dim=1, packed_dim=1, packed_factor=pf, **common,
        )
        layer.scales = make_parameter(
            torch.empty(groups, n, dtype=torch.float32),  # [groups, N]; fp16/bf16 on disk, held exactly
            weight_loader=partial(copy_rows, layout=shards), output_dim=1, **common,
        )
        layer.g_idx = g_idx_parameter(layer, **common)

    def process_after_loading(self, layer, device: torch.device) -> None:
        cfg, n, k = self.cfg, layer.output_size, layer.input_size
        q = unpack_rows(layer.qweight.data, cfg.bits, k)  # [K, N]
        zeros = gptq_zero_points(layer.qzeros.data, cfg.bits, n, cfg.v2)  # [groups, N]
        weights = IntWeights(q, layer.scales.data, zeros.float(), cfg.bits, k if cfg.group_size == -1 else cfg.group_size,
                             self._g_idx(layer))
        remove_parameters(layer, *_CHECKPOINT_TENSORS)
        self.layout = install_int_weights(layer, weights, device, cfg.describe())

    def _g_idx(self, layer) -> torch.Tensor | None:
        act_order = self.cfg.desc_act and self.cfg.group_size != -1
        tensor = f"{self.module_names[0]}.g_idx"
        g_idx = loaded_g_idx(layer, layer.g_idx, source=self.cfg.source, tensor=tensor, module_names=self.module_names,
                             required="the quantization config says desc_act=true (act-order), which needs each "
                                      "layer's group indices" if act_order else None)
        return rank_group_indices(layer, g_idx, self.cfg.group_size, self.cfg.desc_act, tensor)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        group = layer.input_size if self.cfg.group_size == -1 else self.cfg.group_size
        return self.layout.linear(layer, x, self.cfg.bits, group)


def gptq_config(config: dict, source) -> GptqConfig:
    """GptqConfig from a `quantization_config` dict or a quantize_config.json side file."""
    fmt = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
    if fmt == "marlin" or config.get("is_marlin_format"):
        raise UnsupportedError(f"{source}: GPTQ checkpoint_format 'marlin' (AutoGPTQ's Marlin-packed files) is not "
                               f"supported; re-export in the 'gptq' format")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
    bits = config.get("bits", config.get("w_bit", config.get("wbits")))
    if bits not in SUPPORTED_BITS:
        raise UnsupportedError(f"{source}: GPTQ bits={bits!r} is not supported; supported: {list(SUPPORTED_BITS)}")
    group = config.get("group_size", config.get("q_group_size", -1))
    if not isinstance(group, int) or (group != -1 and group <= 0):
        raise ConfigError(f"{source}: GPTQ group_size={group!r}; expected a positive integer or -1")
    return GptqConfig(bits, group, bool(config.get("desc_act", False)), bool(config.get("sym", True)),
                      fmt == "gptq_v2", str(source))


def dynamic_rules(config: dict, base: GptqConfig, source) -> tuple[list[str], list[tuple[str, GptqConfig]]]:
    """GPTQModel's `dynamic` overrides: (skip patterns, [(regex, config for matching modules)])."""
    skip, overrides = [], []
    for pattern, values in (config.get("dynamic") or {}).items():
        if pattern.startswith("-:"):
            skip.append("re:" + pattern[2:])
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: GPTQ dynamic[{pattern!r}] should map option names to values")
        known = {"bits", "group_size", "desc_act", "sym"}
        if set(values) - known:
            raise UnsupportedError(f"{source}: GPTQ dynamic[{pattern!r}] overrides {sorted(set(values) - known)}; "
                                   f"qrt supports overriding {sorted(known)}")
        merged = {**base.__dict__, **values}
        checked = gptq_config({**merged, "checkpoint_format": "gptq_v2" if base.v2 else "gptq"}, source)
        overrides.append((pattern.removeprefix("+:"), replace(checked, source=base.source)))
    return skip, overrides


def _reads_as_gptq(config: dict) -> bool:
    """An AutoGPTQ quantize_config.json: AutoAWQ's side file says zero_point or version instead."""
    return "zero_point" not in config and "version" not in config


@stored_format("gptq", computes=("qrt.int_linear",),
               summary="GPTQ 2/4/8-bit (AutoGPTQ, GPTQModel, optimum): groups or channels, act-order, "
               "v1/v2 zero points, GPTQModel dynamic rules", claims_side_file=_reads_as_gptq)
def gptq_scheme(config: dict, source) -> QuantScheme:
    base = gptq_config(config, source)
    skip, overrides = dynamic_rules(config, base, source)
    blocks = config.get("modules_in_block_to_quantize")
    if blocks:
        names = "|".join(re.escape(name) for group in blocks for name in group)
        skip.append(rf"re:.*\.layers\.\d+\.(?!(?:{names})$)")  # layer modules not listed stay dense

    def make(module_names):
        chosen = {next((cfg for pattern, cfg in overrides if re.match(pattern, name)), base) for name in module_names}
        if len(chosen) > 1:
            raise UnsupportedError(f"{source}: GPTQ dynamic rules give the fused shards {module_names} different "
                                   f"settings; qrt runs them as one matmul")
        return GptqLinearMethod(chosen.pop(), module_names)

    return QuantScheme("gptq", make, skip, base.describe(), quantized_lm_head=bool(config.get("lm_head", False)))
