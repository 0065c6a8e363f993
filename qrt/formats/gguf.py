"""llama.cpp GGUF weights run in their own quantization: the `gguf` format of a GGUF file loaded
as stored (checkpoint/gguf.py gives its config a `quantization_config` with each tensor's GGML
type).

The types in `gguf_blocks.BLOCK_TYPES` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are decoded, exactly,
into the neutral integer form (`IntWeights`) that every integer kernel packs from, and run on the
kernel chosen for its width and group; a fused layer whose shards are stored in different ones of
them runs as one, at the widest codes and finest groups among them. Every other type (F16, the
other K-quants) arrives dequantized to the model dtype and runs as a dense layer, as does a fused
layer with a shard in one.
"""

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from qrt.kernels.choices import choose
from qrt.kernels.int_reference import IntWeights

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.gguf_blocks import BLOCK_TYPES, decode_blocks
from qrt.formats.int_weights import copy_ints, install_int_weights, remove_parameters
from qrt.formats.registry import stored_format
from qrt.formats.scheme import QuantScheme
from qrt.layers.linear import LinearMethod, ShardLayout, check_shape, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT



@dataclass(frozen=True)
class GgufConfig:
    tensor_types: dict  # Hugging Face tensor name -> GGML type name
    source: str

    def types_of(self, module_names) -> list[str]:
        return [self.tensor_types.get(f"{name}.weight", "absent") for name in module_names]


def _dequantize(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """Blocks of any GGML type in fp32 [N, K], by gguf-py's dequantizer (llama.cpp's reference)."""
    from gguf import GGMLQuantizationType, dequantize

    rows = blocks.reshape(blocks.shape[0], -1).numpy()  # [N, blocks · bytes], as gguf-py reads them
    return torch.from_numpy(np.array(dequantize(rows, GGMLQuantizationType[ggml_type]), copy=True))


class GgufLinearMethod(LinearMethod):
    """One linear layer of a GGUF file, in one of three forms chosen from its shards' types:

    - blocks: every shard in one kept type; the file's blocks are held as read and decoded once,
      after loading (the fewest bytes in memory while the model loads);
    - codes: shards in different kept types (llama.cpp's mixes store v, or down, in a wider type
      than q and k); each shard is decoded as it loads into codes of the widest width and scales
      of the finest group among them (a coarser group's scale repeated: exact);
    - dense: any shard in another type; values dequantized by gguf-py as they load."""

    name = "gguf"
    # Blocks [N, K / weights, bytes] and values [N, K] alike run along N and K: a row-parallel
    # rank's part of K falls on whole blocks (checked from the shapes by the loader).
    shard_rule = {"weight": DENSE_WEIGHT}

    def __init__(self, cfg: GgufConfig, module_names):
        super().__init__(cfg, module_names)
        self.types = cfg.types_of(self.module_names)
        kinds = [BLOCK_TYPES.get(t) for t in self.types]
        self.kinds = kinds if all(kinds) else None  # None: dense
        self.ggml_type = self.types[0] if self.kinds and len(set(self.types)) == 1 else None  # blocks form
        if self.kinds:
            self.bits = max(kind.bits for kind in self.kinds)
            self.group_size = math.gcd(*(kind.group_size for kind in self.kinds))

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        if self.kinds is None:
            layer.weight = make_parameter(
                torch.empty(n, k, dtype=dtype),  # [N, K], dequantized as it streams in
                weight_loader=partial(self._load_dense, layer=layer), input_dim=1, output_dim=0, quant_format=self.name)
            return
        for kind in self.kinds:
            if k % kind.weights:
                raise UnsupportedError(f"{self.module_names[0]}: {k} input channels do not fill whole {kind.name} "
                                       f"blocks of {kind.weights}")
        if self.ggml_type is not None:
            kind = self.kinds[0]
            layer.weight = make_parameter(
                torch.empty(n, k // kind.weights, kind.bytes, dtype=torch.uint8),  # [N, K / weights, bytes]: the blocks
                weight_loader=partial(copy_ints, layout=layer.shard_layout, dtype=torch.uint8), output_dim=0,
                quant_format=self.name)
            return
        layer.weight = make_parameter(
            torch.empty(n, k, dtype=torch.uint8),  # [N, K] codes, decoded shard by shard
            weight_loader=partial(self._load_codes, layer=layer), input_dim=1, output_dim=0, quant_format=self.name)

    def _load_codes(self, param, loaded: torch.Tensor, shard_id, *, layer) -> None:
        """One shard's blocks of a layer of mixed kept types, decoded into the common codes and groups."""
        shards: ShardLayout = layer.shard_layout
        ggml_type = self.types[shards.shard_ids.index(shard_id)]
        rows = shards.rows(param.data, shard_id)  # [n, K]
        if loaded.dtype != torch.uint8 or loaded.shape[0] != rows.shape[0]:
            raise TensorMismatch(f"shape {list(loaded.shape)} {loaded.dtype}, expected {ggml_type} blocks of "
                                 f"{rows.shape[0]} rows")
        weights = decode_blocks(loaded, ggml_type, layer.input_size)
        repeat = weights.group_size // self.group_size
        rows.copy_(weights.q.t())
        if getattr(layer, "gguf_groups", None) is None:  # made with the first shard, where the codes live
            layer.gguf_groups = param.new_empty(param.shape[0], layer.input_size // self.group_size, 2,
                                                dtype=torch.float32)  # [N, K / G, (scale, zero)]
        groups = shards.rows(layer.gguf_groups, shard_id)  # [n, K / G, 2]
        groups[..., 0] = weights.scales.t().repeat_interleave(repeat, dim=1)
        groups[..., 1] = weights.zeros.t().repeat_interleave(repeat, dim=1)

    def _load_dense(self, param, loaded: torch.Tensor, shard_id, *, layer) -> None:
        """A dense layer's shard: values, or blocks (a fused layer with a shard of another type)."""
        shards: ShardLayout | None = layer.shard_layout
        if loaded.dtype == torch.uint8:
            index = 0 if shards is None else shards.shard_ids.index(shard_id)
            loaded = _dequantize(loaded, self.types[index])
        rows = param.data if shards is None else shards.rows(param.data, shard_id)
        check_shape(loaded, rows.shape)
        if not loaded.dtype.is_floating_point:
            raise TensorMismatch(f"dtype {loaded.dtype}, expected GGUF blocks or float values")
        rows.copy_(loaded)

    def process_after_loading(self, layer, device: torch.device) -> None:
        stored = "/".join(sorted(set(self.types)))
        if self.kinds is None:
            kernel = choose("aten.linear", device.type)
            layer.weight.storage_layout = f"{str(layer.weight.dtype).removeprefix('torch.')} [N, K] dequantized from {stored}"
            layer.weight.kernel, self.layout = kernel.op, kernel.layout
            return
        if self.ggml_type is not None:
            weights = decode_blocks(layer.weight.data, self.ggml_type, layer.input_size)
        else:
            groups = layer.gguf_groups
            weights = IntWeights(layer.weight.data.t().contiguous(), groups[..., 0].t().contiguous(),
                                 groups[..., 1].t().contiguous(), self.bits, self.group_size)
            del layer.gguf_groups
        remove_parameters(layer, "weight")
        self.layout = install_int_weights(layer, weights, device, f"GGUF {stored}")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.kinds is None:
            return self.layout.linear(layer, x)
        return self.layout.linear(layer, x, self.bits, self.group_size)


@stored_format("gguf", summary="llama.cpp GGUF run as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K decoded "
                               "exactly for qrt's integer kernels, other types dequantized (`quant=\"none\"`: all dequantized)",
               detected_from="a `.gguf` file loaded with `quant=None`")
def gguf_scheme(config: dict, source) -> QuantScheme:
    types = dict(config.get("tensor_types") or {})
    cfg = GgufConfig(types, str(source))
    counts = {}
    for name, ggml_type in types.items():
        if name.endswith(".weight") and ggml_type in BLOCK_TYPES:
            counts[ggml_type] = counts.get(ggml_type, 0) + 1
    held = ", ".join(f"{t} x{c}" for t, c in sorted(counts.items())) or "no type qrt runs as stored"
    return QuantScheme("gguf", lambda names: GgufLinearMethod(cfg, names), (),
                       f"gguf ({held} run as stored; other types dequantized)",
                       quantized_lm_head="lm_head.weight" in types)
