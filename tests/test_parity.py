"""Logits and greedy tokens against transformers on the same checkpoint."""

import pytest
import torch

from helpers.checkpoints.tiny import random_ids
from helpers.compare import relative_l2
from qrt import runtime

# Qwen2 (q/k/v biases) compiles in `make test-slow`; Llama, tied and untied, by default.
ARCHS = ["llama_dir", pytest.param("qwen2_dir", marks=pytest.mark.slow), "tied_llama_dir"]
IDS_SHAPE = (2, 24)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_logits_match_transformers(arch, request, compiled, hf_model):
    folder = request.getfixturevalue(arch)
    ids = random_ids(0, IDS_SHAPE)
    with torch.no_grad():
        expected = hf_model(folder)(ids).logits
    got = compiled(folder)(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert relative_l2(got, expected) < 1e-3


@pytest.mark.parametrize("arch", ["llama_dir", "qwen2_dir"])
def test_greedy_generation_matches_transformers(arch, request, compiled, hf_model):
    folder = request.getfixturevalue(arch)
    prompt = random_ids(1, (1, 10))
    with torch.no_grad():
        expected = hf_model(folder).generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    got = compiled(folder).generate(prompt[0].tolist(), max_new_tokens=16, stop_at_eos=False)
    assert got == expected[0, 10:].tolist()


def test_cached_decoding_matches_full_forward(llama_dir, compiled):
    """Prefill + decode through the KV cache gives the logits the no-cache forward gives."""
    model = compiled(llama_dir)
    ids = random_ids(2, (1, 12))
    full = model(ids)[0]  # [T, V]
    with torch.no_grad():
        last = model.prefill(ids[:, :8])
        assert relative_l2(last[0, -1], full[7]) < 1e-4
        for pos in range(8, 12):
            step = model.decode(ids[:, pos:pos + 1], pos)
            assert relative_l2(step[0, -1], full[pos]) < 1e-4


def test_fp8_compiled_kernel_path_matches_the_reference_op(llama_dir, compiled):
    """The swapped CPU kernel computes what the logical op's reference computes."""
    ids = random_ids(3, IDS_SHAPE)
    eager = runtime.compile_model(llama_dir, quant="fp8", compile=False, progress=False, max_seq_len=128)
    reference = eager(ids)
    got = compiled(llama_dir, "fp8")(ids)
    # Same fp8 codes and scales on both sides; only fp32 summation order differs (and an
    # activation that lands on a rounding boundary may pick the neighbouring fp8 code).
    assert relative_l2(got, reference) < 1e-4


def test_fp8_logits_stay_close_to_the_unquantized_model(llama_dir, compiled, hf_model):
    ids = random_ids(4, IDS_SHAPE)
    with torch.no_grad():
        expected = hf_model(llama_dir)(ids).logits
    got = compiled(llama_dir, "fp8")(ids)
    # e4m3 rounds weights and activations to 3 mantissa bits: each matmul input carries up to
    # 2**-4 relative error (about 2**-5.6 RMS for uniformly spread rounding), the errors of weights
    # and activations add, and 2 layers of 4 matmuls compound them. 8% relative L2 bounds that;
    # a wrong scale or shard shows up as 100% or more.
    error = relative_l2(got, expected)
    assert 0.001 < error < 0.08, error
