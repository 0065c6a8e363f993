"""gpt-oss against transformers' own GptOssForCausalLM read from the same file: attention sinks,
alternating sliding-window (8) and full layers, YaRN past its original context (32), routers and
experts with biases and the clamped SwiGLU; compiled, one graph per role, no recompiles. Its
experts in MXFP4: dequantized bit for bit as transformers' `convert_moe_packed_tensors`, and the
model against transformers' model dequantized from the same file."""

import pytest
import torch

from helpers.checkpoints.gpt_oss import (SLIDING_WINDOW, load_reference, make_gpt_oss_checkpoint,
                                        make_gpt_oss_mxfp4_checkpoint)
from helpers.checkpoints.tiny import random_ids
from helpers.compare import relative_l2
from helpers.graph_checks import assert_no_graph_breaks, assert_one_graph_per_role, decode_without_recompiles
from qrt import runtime
from qrt.errors import CheckpointError
from qrt.formats.mxfp4 import mxfp4_weights
from qrt.kernels import native_cpu
from qrt.kernels.lut4_reference import Lut4Weights, unpack_nibbles

PROMPT_LENGTH = 12  # longer than the window, so decode slides from its first step
assert PROMPT_LENGTH > SLIDING_WINDOW
PARITY_SHAPE = (2, 40)  # past the window and YaRN's original context


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """(folder, transformers' float32 model read from it, qrt's compiled model)."""
    folder = tmp_path_factory.mktemp("gpt-oss-fp32")
    make_gpt_oss_checkpoint(folder)
    return folder, load_reference(folder), runtime.compile_model(folder, progress=False, max_seq_len=128)


def test_compiled_logits_match_transformers(fp32):
    _, hf, model = fp32
    ids = random_ids(0, PARITY_SHAPE)
    with torch.no_grad():
        expected = hf(ids).logits
    got = model(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # float32 throughout; only the order of sums differs
    assert relative_l2(got, expected) < 1e-5


def test_32_greedy_tokens_match_transformers(fp32):
    _, hf, model = fp32
    prompt = random_ids(1, (1, PROMPT_LENGTH))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    got = model.generate(prompt[0].tolist(), max_new_tokens=32, stop_at_eos=False)
    assert got == expected[0, PROMPT_LENGTH:].tolist()


def test_decode_steps_match_transformers_with_a_cache(fp32):
    """Each decode step (qrt::decode_attention with the sinks, over the window or the whole cache)
    against transformers stepping its own cache."""
    import transformers

    folder, hf, model = fp32
    ids = random_ids(2, (1, 30))
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        expected = hf(ids[:, :PROMPT_LENGTH], cache=cache, use_cache=True).logits[:, -1]
        assert relative_l2(model.prefill(ids[:, :PROMPT_LENGTH])[:, -1], expected) < 1e-5
        for pos in range(PROMPT_LENGTH, 30):
            expected = hf(ids[:, pos:pos + 1], cache=cache, use_cache=True,
                          position_ids=torch.tensor([[pos]])).logits[0, -1]
            assert relative_l2(model.decode(ids[:, pos:pos + 1], pos)[0, -1], expected) < 1e-5, pos


def test_one_graph_per_role_and_no_decode_recompiles(fp32):
    _, _, model = fp32
    model.generate([5, 6, 7], max_new_tokens=3, stop_at_eos=False)
    model(random_ids(0, PARITY_SHAPE))
    assert_one_graph_per_role(model)
    decode_without_recompiles(model, list(range(10, 30)), 24)
    decode_without_recompiles(model, [3, 1, 4, 1, 5], 4)
    assert_one_graph_per_role(model)
    # Every layer's decode attention, sinks and all, runs qrt's AVX-512 kernel where it is built.
    (graph,) = model.backends["decode"].log.graphs
    expected = "qrt_cpu.decode_attention" if native_cpu.available() else "qrt.decode_attention"
    assert [c.kernel for c in graph.attention_choices] == [expected] * 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dynamo_explain_finds_no_graph_breaks(fp32, role):
    # Last of the tests on this model: explain() resets Dynamo, which discards its compiled graphs.
    assert_no_graph_breaks(fp32[2], role)


@pytest.mark.slow
def test_bf16_checkpoint_matches_transformers_in_bf16(tmp_path):
    make_gpt_oss_checkpoint(tmp_path, dtype=torch.bfloat16)
    hf = load_reference(tmp_path, torch.bfloat16)
    model = runtime.compile_model(tmp_path, progress=False, max_seq_len=128)
    assert model.model.dtype == torch.bfloat16
    ids = random_ids(3, PARITY_SHAPE)
    with torch.no_grad():
        expected = hf(ids).logits.float()
        exact = load_reference(tmp_path, torch.float32)(ids).logits  # the same bf16 weights, in fp32
    got = model(ids)
    # transformers rounds every step to bf16, softmaxes included; qrt's attention and routing
    # weights stay fp32: both sit about as far from the fp32 run of the same weights.
    assert relative_l2(got, exact) < 2 * relative_l2(expected, exact) + 1e-3
    assert relative_l2(got, expected) < 3e-2
    prompt = random_ids(4, (1, PROMPT_LENGTH))
    with torch.no_grad():
        tokens = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, PROMPT_LENGTH:]
    got_tokens = model.generate(prompt[0].tolist(), max_new_tokens=32, stop_at_eos=False)
    assert got_tokens == tokens.tolist()


def test_a_misshapen_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_gpt_oss_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*expected \[4, 64, 64\]"):
        runtime.compile_model(tmp_path, compile=False, progress=False, max_seq_len=64)


def test_decode_attention_sinks_match_transformers_eager_attention():
    """qrt::decode_attention with sinks, over a window of each row's cache, against transformers'
    gpt-oss attention on the same keys (4 query heads over 2 KV heads)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, length = 4, 2, 32, 20
    k_cache, v_cache = (torch.randn(3, kv_heads, length, hd, generator=gen) for _ in range(2))
    q = torch.randn(2, heads, hd, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    slots, first, last = torch.tensor([2, 0]), torch.tensor([5, 0]), torch.tensor([12, 17])
    got = torch.ops.qrt.decode_attention(q, k_cache, v_cache, slots, first, last, hd ** -0.5, 0.0, None, None, sinks)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks, training=False)
    for row in range(2):
        keys = slice(int(first[row]), int(last[row]) + 1)
        k, v = k_cache[slots[row], :, keys][None], v_cache[slots[row], :, keys][None]  # [1, KVH, L, hd]
        expected, _ = eager_attention_forward(module, q[row][None, :, None], k, v, None, hd ** -0.5)
        assert torch.allclose(got[row], expected[0, 0], rtol=1e-5, atol=1e-6), row


@pytest.mark.skipif(native_cpu.why_not_wanted() is not None, reason=f"{native_cpu.why_not_wanted()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_attention_sinks_match_the_reference(dtype):
    """qrt's AVX-512 kernel with sinks (merged with each row's chunks of 128 entries) against the
    reference op, on extents of one entry, within a chunk and over three chunks."""
    assert native_cpu.available(), native_cpu.why_unavailable()  # builds and loads the qrt_cpu ops
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, hd, length = 8, 2, 64, 300
    k_cache, v_cache = (torch.randn(3, kv_heads, length, hd, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(4, heads, hd, generator=gen).to(dtype)
    sinks = (torch.randn(heads, generator=gen) * 3).to(dtype)
    args = (q, k_cache, v_cache, torch.tensor([2, 0, 1, 2]), torch.tensor([5, 0, 250, 0]),
            torch.tensor([12, 299, 299, 0]), hd ** -0.5, 0.0, None, None, sinks)
    expected = torch.ops.qrt.decode_attention(*args)
    got = torch.ops.qrt_cpu.decode_attention(*args)
    # fp32: a few ulp (summation order, the polynomial exp); bf16: an output may round to its neighbour
    assert relative_l2(got, expected) < (1e-6 if dtype == torch.float32 else 4e-3)
    assert relative_l2(got, torch.ops.qrt.decode_attention(*args[:-1])) > 0.1  # the sinks matter here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_attention_sinks_match_the_reference(dtype):
    """Triton's kernel with sinks (each head's online softmax starts from its sink), on the GPU where
    there is one and under the interpreter otherwise."""
    from helpers.kernel_checks import DEVICE, on_device

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, hd, length = 4, 2, 32, 150
    k_cache, v_cache = (torch.randn(2, kv_heads, length, hd, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(3, heads, hd, generator=gen).to(dtype)
    sinks = (torch.randn(heads, generator=gen) * 3).to(dtype)
    args = (q, k_cache, v_cache, torch.tensor([1, 0, 1]), torch.tensor([0, 3, 140]), torch.tensor([0, 100, 149]),
            hd ** -0.5, 0.0, None, None, sinks)
    expected = torch.ops.qrt.decode_attention(*args)
    got = on_device(torch.ops.qrt.decode_attention_triton)(*args)
    # fp32: a few ulp; bf16: the interpreter truncates where a GPU rounds, up to a step of the output
    assert relative_l2(got, expected) < (1e-6 if dtype == torch.float32 else 8e-3), DEVICE
    assert relative_l2(got, torch.ops.qrt.decode_attention(*args[:-1])) > 0.1


def test_mxfp4_dequantizes_bit_for_bit_as_transformers():
    """Every code and a range of exponents, against transformers' own dequantizer of gpt-oss's
    experts ([E, N, K / 32, 16] blocks -> [E, K, N] values)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)  # [E, N, K / 32, 16]
    scales = torch.randint(100, 150, (3, 40, 4), dtype=torch.uint8, generator=gen)  # [E, N, K / 32]
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    for expert in range(3):
        got = mxfp4_weights(blocks[expert], scales[expert]).dequantize()  # [N, K]
        assert torch.equal(got, expected[expert].t()), expert


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(folder, transformers' float32 model dequantized from the MXFP4 file, qrt's eager model of it)."""
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    make_gpt_oss_mxfp4_checkpoint(folder, dtype=torch.float32)
    return folder, load_reference(folder), runtime.compile_model(folder, compile=False, progress=False,
                                                                 max_seq_len=128)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4):
    """Each expert's codes and scales, as qrt holds them after loading (in the reference layout,
    which a float32 model's experts get), are exactly the weights transformers dequantized from the
    file (gate and up rows de-interleaved)."""
    _, hf, model = mxfp4
    assert model.scheme.name == "mxfp4"
    for index, layer in enumerate(model.model.model.layers):
        experts, reference = layer.mlp.experts, hf.model.layers[index].mlp.experts
        expected = {"gate_up_proj": reference.gate_up_proj.transpose(1, 2),  # [E, N, K]
                    "down_proj": reference.down_proj.transpose(1, 2)}
        for projection in ("gate_up_proj", "down_proj"):
            stacked = getattr(experts, projection)
            assert stacked.weight.kernel == "qrt.lut4_linear"
            want = expected[projection]
            if projection == "gate_up_proj":
                want = torch.cat([want[:, 0::2], want[:, 1::2]], dim=1)
            for e in range(hf.config.num_local_experts):
                w = Lut4Weights(unpack_nibbles(stacked.weight[e]), stacked.weight_table[e], 32,
                                stacked.weight_scales[e], "e8m0")
                assert torch.equal(w.dequantize(), want[e]), (index, projection, e)


def test_mxfp4_model_matches_transformers_dequantized(mxfp4):
    _, hf, model = mxfp4
    ids = random_ids(5, PARITY_SHAPE)
    with torch.no_grad():
        expected = hf(ids).logits
        got = model(ids)
    assert relative_l2(got, expected) < 1e-5  # the same fp32 weights; only the order of sums differs


@pytest.mark.slow
def test_compiled_mxfp4_model_generates_as_transformers(mxfp4):
    folder, hf, _ = mxfp4
    model = runtime.compile_model(folder, progress=False, max_seq_len=128)
    ids = random_ids(5, PARITY_SHAPE)
    with torch.no_grad():
        expected = hf(ids).logits
    assert relative_l2(model(ids), expected) < 1e-5
    prompt = random_ids(6, (1, PROMPT_LENGTH))
    with torch.no_grad():
        tokens = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, PROMPT_LENGTH:]
    assert decode_without_recompiles(model, prompt[0].tolist(), 32) == tokens.tolist()
    assert_one_graph_per_role(model)


@pytest.mark.slow
def test_bf16_mxfp4_model_matches_transformers_in_bf16(tmp_path):
    make_gpt_oss_mxfp4_checkpoint(tmp_path, dtype=torch.bfloat16)
    hf = load_reference(tmp_path, torch.bfloat16)
    model = runtime.compile_model(tmp_path, progress=False, max_seq_len=128)
    ids = random_ids(7, PARITY_SHAPE)
    with torch.no_grad():
        expected = hf(ids).logits.float()
        exact = load_reference(tmp_path, torch.float32)(ids).logits  # the same weights, in fp32
    got = model(ids)
    # As the dense bf16 test: both bf16 runs about as far from the fp32 run of the same weights.
    assert relative_l2(got, exact) < 2 * relative_l2(expected, exact) + 1e-3
    assert relative_l2(got, expected) < 3e-2


@pytest.mark.slow
def test_two_ranks_match_one(tmp_path):
    """tp=2, dense and MXFP4: each rank holds half of the heads (and their sinks) and half of every
    expert's intermediate features, cut from the checkpoint's one tensor per projection."""
    import json
    import os
    from pathlib import Path

    from bench.tp import torchrun_localhost

    ids, prompt = random_ids(8, (2, 20)), random_ids(9, (1, PROMPT_LENGTH))[0].tolist()
    folders = {"dense": tmp_path / "dense", "mxfp4": tmp_path / "mxfp4"}
    make_gpt_oss_checkpoint(folders["dense"])
    make_gpt_oss_mxfp4_checkpoint(folders["mxfp4"], dtype=torch.float32)
    jobs = [dict(name=name, path=str(folder), quant=None, compile=False, ids=ids.tolist(), prompt=prompt, steps=16)
            for name, folder in folders.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    worker = Path(__file__).parent / "helpers" / "tp_worker.py"
    done = torchrun_localhost(2, [str(worker), str(tmp_path / "jobs.json"), str(tmp_path / "results.pt")],
                              {**os.environ, "OMP_NUM_THREADS": "1"}, 300)
    assert done.returncode == 0, done.stderr[-6000:]
    sharded = torch.load(tmp_path / "results.pt")
    for name, folder in folders.items():
        model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=128)
        with torch.no_grad():
            logits = model(ids)
        # fp32 in both: only the two halves' sums of each row-parallel output differ in order
        assert relative_l2(sharded[name]["logits"], logits) < 1e-5, name
        assert sharded[name]["tokens"] == model.generate(prompt, max_new_tokens=16, stop_at_eos=False), name
        shapes = sharded[name]["ranks"][1]["shapes"]
        assert shapes["model.layers.0.self_attn.sinks"] == [2]
        assert shapes["model.layers.0.mlp.experts.down_proj.weight"][0] == 4, name


MINIMAL_CONFIG = {"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "intermediate_size": 64,
                  "num_local_experts": 4}


def test_what_config_json_leaves_out_is_what_transformers_assumes():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from qrt.runtime.models.gpt_oss import GptOssForCausalLM
    from qrt.runtime.models.layers import rope_frequencies

    ours = GptOssForCausalLM.read_config(MINIMAL_CONFIG, "config.json")
    theirs = transformers.GptOssConfig(**MINIMAL_CONFIG)
    assert (ours.sliding_window, list(ours.layer_types)) == (theirs.sliding_window, theirs.layer_types)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert (ours.head_dim, ours.rms_norm_eps, ours.moe.top_k) == (theirs.head_dim, theirs.rms_norm_eps,
                                                                  theirs.num_experts_per_tok)
    inv_freq, attention_factor = rope_frequencies(ours.rope)
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    assert torch.allclose(inv_freq, expected_freq, rtol=1e-6) and attention_factor == pytest.approx(expected_factor)


@pytest.mark.parametrize("key", ["swiglu_limit", "swiglu_alpha"])
def test_other_swiglu_constants_are_refused(key):
    from qrt.errors import UnsupportedError
    from qrt.runtime.models.gpt_oss import GptOssForCausalLM

    with pytest.raises(UnsupportedError, match=key):
        GptOssForCausalLM.read_config({**MINIMAL_CONFIG, key: 5.0}, "config.json")
