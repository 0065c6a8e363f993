"""llama.cpp GGUF weights run in their own quantization: the `gguf` format of a GGUF file loaded
as stored (checkpoint/gguf.py gives its config a `quantization_config` with each tensor's GGML
type).

The types with a layout of their own here are repacked, exactly, into the neutral integer form
(`IntWeights`) that every integer kernel packs from; a block of 32 weights along K is one group:

| type | block (bytes) | weight | as IntWeights |
|---|---|---|---|
| Q4_0 | d: fp16, 16 bytes of 4-bit codes (18) | d · (q − 8) | 4-bit, scale d, zero 8 |
| Q4_1 | d, m: fp16, 16 bytes of 4-bit codes (20) | d · q + m | 4-bit, scale d, zero −m / d |
| Q8_0 | d: fp16, 32 int8 codes (34) | d · q | 8-bit, q + 128, scale d, zero 128 |

In each block of 16 code bytes, byte j holds element j in its low nibble and element j + 16 in its
high one (ggml's `block_q4_0`). A Q4_1 block with d = 0 is m throughout: its codes become 1 with
scale m and zero 0, the same weights. Every other type (the K-quants, F16) arrives dequantized to
the model dtype and runs as a dense layer, as does a fused layer whose shards differ in type.
"""

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from qrt.kernels.choices import choose
from qrt.kernels.int_reference import IntWeights

from qrt.errors import TensorMismatch, UnsupportedError
from qrt.formats.int_weights import copy_ints, install_int_weights, remove_parameters
from qrt.formats.registry import stored_format
from qrt.formats.scheme import QuantScheme
from qrt.layers.linear import LinearMethod, ShardLayout, check_shape, make_parameter
from qrt.layers.tensor_parallel import DENSE_WEIGHT

BLOCK = 32  # weights per block along K, for every type below
# GGML type -> (bytes per block, bits of its codes)
_BLOCKS = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q8_0": (34, 8)}


@dataclass(frozen=True)
class GgufConfig:
    tensor_types: dict  # Hugging Face tensor name -> GGML type name
    source: str

    def types_of(self, module_names) -> list[str]:
        return [self.tensor_types.get(f"{name}.weight", "absent") for name in module_names]


def decode_blocks(blocks: torch.Tensor, ggml_type: str, k: int) -> IntWeights:
    """A tensor's blocks, uint8 [N, K / 32, block bytes] (or [N, K / 32 · block bytes], as gguf-py
    writes them), as IntWeights (q [K, N], groups of 32)."""
    size, bits = _BLOCKS[ggml_type]
    n = blocks.shape[0]
    grid = blocks.reshape(n, k // BLOCK, size)  # [N, K / 32, bytes]
    d = grid[..., :2].contiguous().view(torch.float16).float()[..., 0]  # [N, K / 32]
    if ggml_type == "Q8_0":
        q = (grid[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # [N, K / 32, 32]
        zeros = torch.full_like(d, 128.0)
    else:
        packed = grid[..., size - 16:]  # [N, K / 32, 16]
        q = torch.cat([packed & 0xF, packed >> 4], dim=-1)  # [N, K / 32, 32]: low nibbles first
        if ggml_type == "Q4_0":
            zeros = torch.full_like(d, 8.0)
        else:
            m = grid[..., 2:4].contiguous().view(torch.float16).float()[..., 0]  # [N, K / 32]
            flat = d == 0  # the block is m throughout: codes 1, scale m, zero 0
            q = torch.where(flat[..., None], torch.ones_like(q), q)
            zeros = torch.where(flat, torch.zeros_like(d), -m / torch.where(flat, torch.ones_like(d), d))
            d = torch.where(flat, m, d)
    q = q.reshape(n, k).t().contiguous()  # [K, N]
    return IntWeights(q, d.t().contiguous(), zeros.t().contiguous(), bits, BLOCK)


def _dequantize(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """Blocks of any GGML type in fp32 [N, K], by gguf-py's dequantizer (llama.cpp's reference)."""
    from gguf import GGMLQuantizationType, dequantize

    rows = blocks.reshape(blocks.shape[0], -1).numpy()  # [N, K / 32 · bytes], as gguf-py reads them
    return torch.from_numpy(np.array(dequantize(rows, GGMLQuantizationType[ggml_type]), copy=True))


class GgufLinearMethod(LinearMethod):
    name = "gguf"
    # Blocks [N, K / 32, bytes] and values [N, K] alike run along N and K: a row-parallel rank's
    # part of K falls on whole blocks of 32 (checked from the shapes by the loader).
    shard_rule = {"weight": DENSE_WEIGHT}

    def __init__(self, cfg: GgufConfig, module_names):
        super().__init__(cfg, module_names)
        types = cfg.types_of(self.module_names)
        # Run as stored: every shard in one type of its own layout here.
        self.ggml_type = types[0] if len(set(types)) == 1 and types[0] in _BLOCKS else None
        self.types = types

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        if self.ggml_type is None:
            layer.weight = make_parameter(
                torch.empty(n, k, dtype=dtype),  # [N, K], dequantized as it streams in
                weight_loader=partial(self._load_dense, layer=layer), input_dim=1, output_dim=0, quant_format=self.name)
            return
        if k % BLOCK:
            raise UnsupportedError(f"{self.module_names[0]}: {k} input channels do not fill whole GGUF blocks of {BLOCK}")
        size, _ = _BLOCKS[self.ggml_type]
        layer.weight = make_parameter(
            torch.empty(n, k // BLOCK, size, dtype=torch.uint8),  # [N, K / 32, block bytes]: the file's blocks
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
        return self.layout.linear(layer, x, _BLOCKS[self.ggml_type][1], BLOCK)


@stored_format("gguf", summary="llama.cpp GGUF run as stored: Q4_0, Q4_1 and Q8_0 repacked exactly for qrt's integer "
                               "kernels, other types dequantized (`quant=\"none\"`: all dequantized)",
               detected_from="a `.gguf` file loaded with `quant=None`")
def gguf_scheme(config: dict, source) -> QuantScheme:
    types = dict(config.get("tensor_types") or {})
    cfg = GgufConfig(types, str(source))
    counts = {}
    for name, ggml_type in types.items():
        if name.endswith(".weight") and ggml_type in _BLOCKS:
            counts[ggml_type] = counts.get(ggml_type, 0) + 1
    held = ", ".join(f"{t} x{c}" for t, c in sorted(counts.items())) or "no type qrt runs as stored"
    return QuantScheme("gguf", lambda names: GgufLinearMethod(cfg, names), (),
                       f"gguf ({held} run as stored; other types dequantized)",
                       quantized_lm_head="lm_head.weight" in types)
