"""llama.cpp GGUF weights run in their own quantization: the `gguf` format of a GGUF file loaded
as stored (checkpoint/gguf.py gives its config a `quantization_config` with each tensor's GGML
type).

The types in `gguf_blocks.BLOCK_TYPES` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) are decoded, exactly,
into the neutral integer form (`IntWeights`) that every integer kernel packs from, and run on the
kernel chosen for its width and group. Every other type (F16, the other K-quants) arrives
dequantized to the model dtype and runs as a dense layer, as does a fused layer whose shards
differ in type.
"""

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from qrt.kernels.choices import choose

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
    name = "gguf"
    # Blocks [N, K / weights, bytes] and values [N, K] alike run along N and K: a row-parallel
    # rank's part of K falls on whole blocks (checked from the shapes by the loader).
    shard_rule = {"weight": DENSE_WEIGHT}

    def __init__(self, cfg: GgufConfig, module_names):
        super().__init__(cfg, module_names)
        types = cfg.types_of(self.module_names)
        # Run as stored: every shard in one type of its own layout here.
        self.ggml_type = types[0] if len(set(types)) == 1 and types[0] in BLOCK_TYPES else None
        self.types = types

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        if self.ggml_type is None:
            layer.weight = make_parameter(
                torch.empty(n, k, dtype=dtype),  # [N, K], dequantized as it streams in
                weight_loader=partial(self._load_dense, layer=layer), input_dim=1, output_dim=0, quant_format=self.name)
            return
        kind = BLOCK_TYPES[self.ggml_type]
        if k % kind.weights:
            raise UnsupportedError(f"{self.module_names[0]}: {k} input channels do not fill whole {kind.name} blocks "
                                   f"of {kind.weights}")
        layer.weight = make_parameter(
            torch.empty(n, k // kind.weights, kind.bytes, dtype=torch.uint8),  # [N, K / weights, bytes]: the file's blocks
            weight_loader=partial(copy_ints, layout=layer.shard_layout, dtype=torch.uint8), output_dim=0,
            quant_format=self.name)

    def _load_dense(self, param, loaded: torch.Tensor, shard_id, *, layer) -> None:
        """A dense layer's shard: values, or blocks of a kept type (a fused layer of mixed types)."""
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
        if self.ggml_type is None:
            kernel = choose("aten.linear", device.type)
            stored = "/".join(sorted(set(self.types)))
            layer.weight.storage_layout = f"{str(layer.weight.dtype).removeprefix('torch.')} [N, K] dequantized from {stored}"
            layer.weight.kernel, self.layout = kernel.op, kernel.layout
            return
        weights = decode_blocks(layer.weight.data, self.ggml_type, layer.input_size)
        remove_parameters(layer, "weight")
        self.layout = install_int_weights(layer, weights, device, f"GGUF {self.ggml_type}")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.ggml_type is None:
            return self.layout.linear(layer, x)
        kind = BLOCK_TYPES[self.ggml_type]
        return self.layout.linear(layer, x, kind.bits, kind.group_size)


@stored_format("gguf", summary="llama.cpp GGUF run as stored: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K decoded "
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
