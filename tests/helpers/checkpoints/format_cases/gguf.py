"""The gguf format: a tiny Llama written as a llama.cpp GGUF file by gguf-py's writer, its linear
weights quantized by gguf-py's quantizer (Q4_0, Q4_1, Q8_0 by layer), the q and k rows permuted as
llama.cpp's converter permutes them.

gguf-py cannot quantize to the K-quants (Q4_K, Q5_K, Q6_K); a layer asked for in one of them gets
random blocks of that type instead (`random_k_blocks`), weights of the usual size whose only
reference is gguf-py's dequantization of the same bytes."""

import numpy as np
import torch
from helpers.checkpoints.tiny import make_checkpoint

from qrt.kernels import native_cpu

from . import INT_CUDA, FormatCase

# The tiny Llama's linears by GGUF name, and the type each is written in: every kept type runs,
# and q/k/v (one fused layer) share one.
_LINEARS = {"attn_q": ("self_attn.q_proj", "Q4_0"), "attn_k": ("self_attn.k_proj", "Q4_0"),
            "attn_v": ("self_attn.v_proj", "Q4_0"), "attn_output": ("self_attn.o_proj", "Q4_1"),
            "ffn_gate": ("mlp.gate_proj", "Q4_1"), "ffn_up": ("mlp.up_proj", "Q4_1"),
            "ffn_down": ("mlp.down_proj", "Q8_0")}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders q and k rows from HF's rotate-half halves into
    interleaved pairs (what its RoPE reads)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


K_QUANTS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block of 256 weights


def random_k_blocks(ggml_type: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant, uint8 [rows, K / 256 · bytes]: every code, scale and min byte
    drawn uniformly, the fp16 super-block scales drawn so that the weights are of the size a
    linear layer's are (|w| up to about 0.1)."""
    rng = np.random.default_rng(seed)
    size = K_QUANTS[ggml_type]
    blocks = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)  # [N, K / 256, bytes]
    scale = rng.uniform(0.2, 1.0, (rows, k // 256, 2)) * 1e-4
    if ggml_type == "Q6_K":  # d at bytes 208..209
        blocks[..., 208:210] = scale[..., :1].astype(np.float16).view(np.uint8)
    else:  # d, dmin at bytes 0..3
        blocks[..., 0:4] = scale.astype(np.float16).view(np.uint8).reshape(rows, k // 256, 4)
    return blocks.reshape(rows, -1)


def _metadata(writer, arch: str, config) -> None:
    """The `{arch}.*` keys transformers reads a config from (its GGUF_CONFIG_MAPPING), from `config`."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    for key, attribute in GGUF_CONFIG_MAPPING[arch].items():
        value = config.rope_parameters["rope_theta"] if attribute == "rope_theta" else getattr(config, attribute or "", None)
        if value is None:
            continue
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        writer.add_key_value(f"{arch}.{key}", value, kind)


def _gguf_names(model, arch: str) -> dict[str, str]:
    """Hugging Face tensor name -> GGUF name, by transformers' own map (the one qrt reads with)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    return {hf: name for name, hf in get_gguf_hf_weights_map(model, TensorProcessor(), model_type=arch).items()}


def write_gguf(folder, arch: str = "llama", types: dict | None = None, tie: bool = False, seed: int = 0, **sizes):
    """A tiny `arch` model (llama, qwen2, qwen3; llama.cpp writes Mistral as llama) as `folder`/model.gguf; returns the HF
    model it was made from (float32). types: GGUF linear name ("attn_q", ...) -> GGML type (default
    _LINEARS'); sizes: config overrides (the K-quants need input sizes that are multiples of 256).
    Norms and embeddings are F32, the output layer Q8_0; llama has its q and k rows
    permuted as llama.cpp's converter does."""
    import gguf

    model = make_checkpoint(folder / "hf", arch, seed=seed, tie=tie, **sizes)
    cfg = model.config
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), arch)
    _metadata(writer, arch, cfg)
    linear_types = {short: default for short, (_, default) in _LINEARS.items()} | (types or {})

    def add(name, array, ggml_type):
        if ggml_type == "F32":
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif ggml_type in K_QUANTS:
            blocks = random_k_blocks(ggml_type, array.shape[0], array.shape[1], seed=1000 * seed + len(writer.tensors[0]))
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[ggml_type])
        else:
            kind = gguf.GGMLQuantizationType[ggml_type]
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)

    names = _gguf_names(model, arch)
    for hf_name, tensor in model.state_dict().items():
        if tie and hf_name == "lm_head.weight":
            continue
        name, array = names[hf_name], tensor.float().numpy()
        short = name.split(".")[-2]  # attn_q, ffn_down, output, token_embd, ...
        if arch == "llama" and short in ("attn_q", "attn_k") and array.ndim == 2:
            heads = cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        ggml_type = "F32" if array.ndim == 1 else "Q8_0" if short == "output" else linear_types.get(short, "F32")
        add(name, array, ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _case(folder) -> None:
    write_gguf(folder)
    # The model is the GGUF alone: no config.json beside it.
    for path in sorted((folder / "hf").iterdir()):
        path.unlink()
    (folder / "hf").rmdir()


# float32, as the other cases' checkpoints are (a GGUF file names no dtype: bf16 by default),
# so that compiled and eager agree to float32 rounding and no dense layer is packed for bf16.
# Q4_0/Q4_1 layers run the int4 kernel, Q8_0 (ffn_down) the byte-wide grouped one where qrt's library
# is built; without it (a CPU without AVX-512) Q8_0 is dequantized for ATen's linear, which no pass swaps.
CPU_KERNELS = frozenset({"qrt.int4pack_linear", *(["qrt.int8_groups_linear"] if native_cpu.available() else [])})
CASES = {"stored:gguf": FormatCase(_case, None, CPU_KERNELS, INT_CUDA, dtype="float32")}
