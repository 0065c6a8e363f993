"""GGUF (llama.cpp) files: config and tokenizer from the file's metadata, tensors read one at a
time with positioned reads (gguf_reader.py), so that nothing of the file stays mapped or resident.

Loaded as stored (quant=None), the tensors of the types qrt runs quantized (`KEPT_TYPES`) stay
the file's blocks, uint8 [N, bytes per row], for the `gguf` format's loader pass
(formats/gguf.py); every other tensor is dequantized to the model dtype as it is read, with
gguf-py's own dequantizer. Asked for another quantization (quant="fp8", ...), every tensor is
dequantized. llama.cpp's permutation of the q and k rows (Llama) is undone on whichever form
is read: it moves whole rows, so it applies to blocks as to values.
"""

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from qrt.checkpoint.gguf_config import gguf_config
from qrt.checkpoint.gguf_names import hf_names
from qrt.checkpoint.gguf_reader import GgufHeader, GgufTensorInfo, block_size, read_gguf_header
from qrt.errors import CheckpointError, TensorMismatch, UnsupportedError
from qrt.layers.tensor_parallel import cut_tensor

# The GGML types qrt runs as stored (formats/gguf_blocks.py decodes each): 4- and 5-bit codes with a
# scale (Q4_0, Q5_0) or a scale and an offset (Q4_1, Q5_1) per 32 weights, 8-bit codes with a scale
# per 32 (Q8_0),
# and the K-quants' super-blocks of 256: 4- and 5-bit codes with a scale and a min per 32 (Q4_K,
# Q5_K), 6-bit codes with a scale per 16 (Q6_K).
KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# fp32 values dequantized at a time: a large embedding never exists whole in fp32.
_DEQUANTIZE_CHUNK_BYTES = 8 << 20


def _config(header: GgufHeader):
    try:
        return gguf_config(header)
    except (ValueError, KeyError, OSError) as err:
        raise CheckpointError(header.path, None, f"cannot read the GGUF metadata ({err})") from None


def _hf_config(config, path: Path) -> dict:
    """The Hugging Face config dict of a GGUF's transformers config, with the architecture qrt's
    registry knows it by: transformers' causal-LM class for the model type, where qrt runs it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # Whether qrt runs it is the model registry's to say, with the list of what it runs.
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise UnsupportedError(f"{path}: a GGUF of model type {config.model_type!r}, which is not a causal language "
                               f"model transformers knows")
    hf_config = config.to_dict()
    hf_config["architectures"] = [arch]
    return hf_config


class GgufFile:
    """One GGUF file: its config and its tensors under their Hugging Face names. The header is
    parsed once and serves both."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header = read_gguf_header(self.path)
        self.config = _config(self.header)  # transformers' config object
        self.hf_config = _hf_config(self.config, self.path)

    @cached_property
    def _names(self) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face name (transformers' map for the architecture)."""
        return hf_names(self.config, self._processor)

    @cached_property
    def _processor(self):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        architecture = self.header.metadata["general.architecture"]
        return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self.hf_config)

    def untie_quantized_output(self) -> bool:
        """Run a tied output layer from the embedding's blocks, when they are of a kept type: the
        embedding is looked up by rows and so dequantized, but the output layer reads all of it at
        every decode step, and reads its codes (about half of bf16's bytes in Q8_0) far faster.
        The config then says untied, and `lm_head.weight` is the embedding's blocks. Returns
        whether it does."""
        tensors = self.header.tensors
        embedding = next((t for t in tensors if self._names.get(t.name) == "model.embed_tokens.weight"), None)
        has_output = any(self._names.get(t.name) == "lm_head.weight" for t in tensors)
        if embedding is not None and not has_output and embedding.type_name in KEPT_TYPES:
            self.hf_config["tie_word_embeddings"] = False
            self._output_from = embedding
        return self._output_from is not None

    _output_from = None  # the embedding tensor the output layer is read from (untie_quantized_output)

    def _loaded(self) -> list:
        """(Hugging Face name, GGUF tensor table entry) of every tensor qrt loads."""
        loaded = [(self._names[t.name], t) for t in self.header.tensors if t.name in self._names]
        return loaded + ([("lm_head.weight", self._output_from)] if self._output_from is not None else [])

    def tensor_types(self) -> dict[str, str]:
        """Hugging Face name -> GGML type name ("Q4_1", "F32", ...) of every tensor qrt loads."""
        return {name: t.type_name for name, t in self._loaded()}

    def tensors(self, dtype: torch.dtype, keep_quantized: bool) -> list:
        """(Hugging Face name, GgufTensor) of every tensor qrt loads, read when the loader asks."""
        loaded = self._loaded()
        return [(name, GgufTensor(self.header, t, self._processor, dtype,
                                  keep_quantized and runs_as_stored(name, t.type_name, len(t.shape))))
                for name, t in loaded]


def runs_as_stored(name: str, ggml_type: str, dims: int) -> bool:
    """Whether tensor `name` of `ggml_type` is handed over as its blocks: a linear layer's weight
    [N, K] of a kept type. The token embedding is looked up by rows, and the experts of a
    mixture-of-experts layer ([E, N, K]) load through their own layer: both are dequantized."""
    return (ggml_type in KEPT_TYPES and dims == 2 and name.endswith(".weight")
            and not name.endswith("embed_tokens.weight"))


class GgufTensor:
    """A tensor of the file, read (and dequantized unless `raw`) when the loader asks: only one
    tensor's worth of memory beyond the model's at a time."""

    def __init__(self, header: GgufHeader, tensor: GgufTensorInfo, processor, dtype: torch.dtype, raw: bool):
        self._header, self._tensor, self._processor, self._dtype, self.raw = header, tensor, processor, dtype, raw
        self.ggml_type = tensor.type_name

    @property
    def shape(self) -> tuple:
        if not self.raw:
            return self._tensor.shape
        weights_per_block, block_bytes = block_size(self._tensor.ggml_type)
        return (*self._tensor.shape[:-1], self._tensor.shape[-1] // weights_per_block, block_bytes)

    def read(self, cuts=()) -> torch.Tensor:
        """raw: the blocks, uint8 [N, K / weights per block, bytes per block] (a rank's part of K is
        whole blocks);
        else the values in the model dtype."""
        blocks = self._header.read_tensor(self._tensor)  # uint8 [*shape[:-1], row bytes]
        if self.raw:
            tensor = torch.from_numpy(self._process(blocks)).reshape(self.shape)
        elif blocks.ndim >= 2 and _moves_rows_only(self._processor):
            tensor = self._dequantize_rows(self._process(blocks))
        else:  # the processor works on values (or the tensor is one row): dequantized whole
            from gguf import dequantize

            tensor = torch.from_numpy(self._process(dequantize(blocks, self._tensor.quant_type))).to(self._dtype)
        return cut_tensor(tensor, cuts) if cuts else tensor

    def _process(self, data: np.ndarray) -> np.ndarray:
        """`data` with transformers' per-architecture fix applied (llama.cpp's q/k row order undone)."""
        try:
            return np.ascontiguousarray(self._processor.process(weights=data, name=self._tensor.name).weights)
        except ValueError as err:  # llama.cpp's q/k row order cannot be undone on these rows
            raise TensorMismatch(f"shape {list(self.shape)} does not hold the model's attention heads ({err})") from None

    def _dequantize_rows(self, blocks: np.ndarray) -> torch.Tensor:
        """The values of `blocks` (uint8 [*shape[:-1], row bytes]) in the model dtype, [*shape],
        dequantized a chunk of rows (about _DEQUANTIZE_CHUNK_BYTES of fp32) at a time."""
        from gguf import dequantize

        rows = blocks.reshape(-1, blocks.shape[-1])  # [R, row bytes]
        out = torch.empty(rows.shape[0], self._tensor.shape[-1], dtype=self._dtype)  # [R, K]
        step = max(1, _DEQUANTIZE_CHUNK_BYTES // (4 * self._tensor.shape[-1]))
        for start in range(0, rows.shape[0], step):
            out[start:start + step] = torch.from_numpy(dequantize(rows[start:start + step], self._tensor.quant_type))
        return out.reshape(self._tensor.shape)


def _moves_rows_only(processor) -> bool:
    """Whether transformers' processor at most reorders whole rows (llama.cpp's q/k permutation, or
    nothing): then it acts on the blocks as on the values, before they are dequantized in chunks."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor

    return type(processor) in (TensorProcessor, LlamaTensorProcessor)

