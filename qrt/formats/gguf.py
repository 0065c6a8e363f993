"""llama.cpp GGUF weights run in their own quantization: the `gguf` format of a GGUF file loaded
as stored (checkpoint/gguf.py gives its config a `quantization_config` with each tensor's GGML
type).

The types in `gguf_blocks.BLOCK_TYPES` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) run on the
kernel that reads their codes at their own width with the file's two levels of scales
(`qrt.superblock_linear`, on the CPU; a fused layer whose shards are stored in different types runs
each run of shards of one type as a part of its own), or else are decoded, exactly, into the
neutral integer form (`IntWeights`) that every integer kernel packs from and run on the kernel
chosen for its width and group (a fused layer of mixed types as one, at the widest codes and finest
groups among them). Every other type (F16, the
other K-quants) arrives dequantized to the model dtype and runs as a dense layer, as does a fused
layer with a shard in one.
"""

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from qrt.kernels.choices import NoKernelError, choose
from qrt.kernels.int_reference import IntWeights

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.gguf_blocks import BLOCK_TYPES, decode_blocks, superblock_weights
from qrt.formats.int_weights import install_int_weights, remove_parameters, shard_slot
from qrt.formats.registry import stored_format
from qrt.formats.scheme import QuantScheme
from qrt.layers.linear import LinearMethod, ShardLayout, check_shape, install_packed, make_parameter
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


def _row_bytes(kind, k: int) -> int:
    return k // kind.weights * kind.bytes


class GgufLinearMethod(LinearMethod):
    """One linear layer of a GGUF file, in one of two forms chosen from its shards' types:

    - blocks: every shard in a kept type; each shard's blocks are held as read, uint8 [N, row bytes]
      (a row as wide as the widest type's, where llama.cpp's mixes store v, or down, in a wider type
      than q and k), the fewest bytes in memory while the model loads. After loading they go to the
      kernel that reads the codes at their own width (on the CPU: each run of shards of one type a
      part of its own), or else are decoded into the neutral integer form, at the widest codes and
      finest groups among the shards (a coarser group's scale repeated: exact);
    - dense: any shard in another type; values dequantized by gguf-py as they load."""

    name = "gguf"
    # Blocks [N, row bytes] and values [N, K] alike run along N and K: a row-parallel rank's part
    # of K falls on whole blocks (checked from the shapes by the loader).
    shard_rule = {"weight": DENSE_WEIGHT}

    def __init__(self, cfg: GgufConfig, module_names):
        super().__init__(cfg, module_names)
        self.types = cfg.types_of(self.module_names)
        kinds = [BLOCK_TYPES.get(t) for t in self.types]
        self.kinds = kinds if all(kinds) else None  # None: dense
        self.ggml_type = self.types[0] if self.kinds and len(set(self.types)) == 1 else None  # one type throughout
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
        layer.weight = make_parameter(
            torch.empty(n, max(_row_bytes(kind, k) for kind in self.kinds), dtype=torch.uint8),  # [N, row bytes]
            weight_loader=partial(self._load_blocks, layer=layer), output_dim=0, quant_format=self.name)

    def _load_blocks(self, param, loaded: torch.Tensor, shard_id, *, layer) -> None:
        """One shard's blocks, as stored, into its rows."""
        kind = self.kinds[shard_slot(layer, shard_id)]
        rows = param.data if layer.shard_layout is None else layer.shard_layout.rows(param.data, shard_id)
        row_bytes = _row_bytes(kind, layer.input_size)
        if loaded.dtype != torch.uint8 or loaded.numel() != rows.shape[0] * row_bytes:
            raise TensorMismatch(f"shape {list(loaded.shape)} {loaded.dtype}, expected {kind.name} blocks of "
                                 f"{rows.shape[0]} rows x {layer.input_size} inputs")
        rows[:, :row_bytes].copy_(loaded.reshape(rows.shape[0], row_bytes))

    def _load_dense(self, param, loaded: torch.Tensor, shard_id, *, layer) -> None:
        """A dense layer's shard: values, or blocks (a fused layer with a shard of another type)."""
        shards: ShardLayout | None = layer.shard_layout
        if loaded.dtype == torch.uint8:
            loaded = _dequantize(loaded, self.types[shard_slot(layer, shard_id)])
        rows = param.data if shards is None else shards.rows(param.data, shard_id)
        check_shape(loaded, rows.shape)
        if not loaded.dtype.is_floating_point:
            raise TensorMismatch(f"dtype {loaded.dtype}, expected GGUF blocks or float values")
        rows.copy_(loaded)

    def _shard_blocks(self, layer) -> list[tuple[str, torch.Tensor]]:
        """(type, blocks uint8 [n, row bytes]) of each shard, in order along N; runs of one type merged."""
        shards: ShardLayout | None = layer.shard_layout
        slots = [layer.weight.data] if shards is None else [shards.rows(layer.weight.data, i) for i in shards.shard_ids]
        runs: list[tuple[str, list]] = []
        for ggml_type, kind, rows in zip(self.types, self.kinds, slots):
            blocks = rows[:, :_row_bytes(kind, layer.input_size)]
            if runs and runs[-1][0] == ggml_type:
                runs[-1][1].append(blocks)
            else:
                runs.append((ggml_type, [blocks]))
        return [(t, parts[0] if len(parts) == 1 else torch.cat(parts)) for t, parts in runs]

    def _int_weights(self, runs, k: int) -> IntWeights:
        """The runs' blocks decoded into one set of codes of the widest width and groups of the finest size."""
        decoded = [decode_blocks(blocks, ggml_type, k) for ggml_type, blocks in runs]
        if len(decoded) == 1:
            return decoded[0]

        def finest(values, w):  # [K / g', n] -> [K / g, n]: a coarser group's value repeated
            return values.repeat_interleave(w.group_size // self.group_size, dim=0)

        return IntWeights(torch.cat([w.q for w in decoded], dim=1),
                          torch.cat([finest(w.scales, w) for w in decoded], dim=1),
                          torch.cat([finest(w.zeros, w) for w in decoded], dim=1), self.bits, self.group_size)

    def process_after_loading(self, layer, device: torch.device) -> None:
        stored = "/".join(sorted(set(self.types)))
        if self.kinds is None:
            kernel = choose("aten.linear", device.type)
            layer.weight.storage_layout = f"{str(layer.weight.dtype).removeprefix('torch.')} [N, K] dequantized from {stored}"
            layer.weight.kernel, self.layout = kernel.op, kernel.layout
            return
        k = layer.input_size
        runs = self._shard_blocks(layer)
        parts = [superblock_weights(blocks, ggml_type, k) for ggml_type, blocks in runs]
        try:
            kernel = choose("qrt.superblock_linear", device.type, parts=parts, dtype=layer.params_dtype)
        except NoKernelError:
            kernel = None
        if kernel is not None:
            remove_parameters(layer, "weight")
            install_packed(layer, kernel.layout.pack(parts, layer.params_dtype), kernel.op, f"GGUF {stored}")
            self.layout = kernel.layout
            return
        del parts
        weights = self._int_weights(runs, k)
        remove_parameters(layer, "weight")
        self.layout = install_int_weights(layer, weights, device, f"GGUF {stored}")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.kinds is None:
            return self.layout.linear(layer, x)
        return self.layout.linear(layer, x, self.bits, self.group_size)


@stored_format("gguf", computes=("qrt.superblock_linear", "qrt.int_linear", "aten.linear"),
               summary="llama.cpp GGUF run as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K at their own "
                               "width on the CPU, Q8_0 (and every kept type on GPUs) decoded exactly for qrt's integer "
                               "kernels, other types dequantized (`quant=\"none\"`: all dequantized)",
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
