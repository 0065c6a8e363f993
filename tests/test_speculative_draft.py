"""Speculative decoding with a draft model: greedy tokens unchanged alone, in a churn and after
the model reused cached prompt chunks the draft never saw; a draft with the model's own weights
has nearly every guess kept (so its cache follows each request exactly); and the settings that
cannot work are refused with what to change."""

import shutil

import pytest

from helpers.checkpoints.tiny import make_checkpoint
from helpers.speculation import (P_VALUE_FLOOR, always_checking, looping_prompt, run_requests,
                                 two_sampled_tokens_p_value)
from qrt import runtime
from qrt.runtime.engine import Engine
from qrt.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow  # three models compiled: `make test-slow`

K, SLOTS, MAX_SEQ_LEN = 3, 3, 256


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The model, a copy of it (a draft that should guess right) and another random model with
    the same vocabulary (a draft that mostly guesses wrong)."""
    root = tmp_path_factory.mktemp("draft")
    make_checkpoint(root / "model", "llama", max_position_embeddings=MAX_SEQ_LEN)
    shutil.copytree(root / "model", root / "copy")
    make_checkpoint(root / "other", "llama", seed=5, max_position_embeddings=MAX_SEQ_LEN)
    return root


def _compile(folders, draft: str):
    return runtime.compile_model(folders / "model", progress=False, max_seq_len=MAX_SEQ_LEN, max_batch_size=SLOTS,
                                 speculative={"method": "draft", "model": str(folders / draft),
                                              "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def with_copy(folders):
    return _compile(folders, "copy")


@pytest.fixture(scope="module")
def with_other(folders):
    return _compile(folders, "other")


def _requests(model):
    return [model.request(looping_prompt(seed, length), new, SamplingParams(), stop_at_eos=False)
            for seed, length, new in ((11, 30, 40), (12, 9, 30), (13, 70, 35), (14, 3, 25))]


@pytest.mark.parametrize("which", ["copy", "other"])
def test_greedy_tokens_equal_plain_decoding_alone_and_in_a_churn(which, request):
    model = request.getfixturevalue(f"with_{which}")
    requests = _requests(model)
    alone = [run_requests(Engine(model, speculate=False), [r])[0] for r in requests]
    speculating = always_checking(Engine(model))
    assert [run_requests(speculating, [r])[0] for r in requests] == alone
    assert run_requests(speculating, requests, arrivals=[0, 1, 4, 6]) == alone
    spec = speculating.speculator
    assert spec.checks > 0 and spec.proposed > 0
    if which == "copy":  # the same weights: only rounding between M = 1 and M = k + 1 can differ
        assert spec.accepted >= 0.9 * spec.proposed, (spec.accepted, spec.proposed)


def test_the_draft_catches_up_on_chunks_the_model_reused(with_copy):
    """A plain engine leaves the prompt's chunks in the model's cache only; a speculating engine
    then reuses them, and the draft must prefill them itself to keep guessing right."""
    model = with_copy
    request = model.request(looping_prompt(15, 40), 30, SamplingParams(), stop_at_eos=False)
    expected = run_requests(Engine(model, chunk_size=16, speculate=False), [request])[0]
    before = model.prefix_cache.reused_tokens
    speculating = always_checking(Engine(model, chunk_size=16))
    assert run_requests(speculating, [request])[0] == expected
    assert model.prefix_cache.reused_tokens - before == 32  # two whole chunks were not prefilled
    spec = speculating.speculator
    assert spec.proposed > 0 and spec.accepted >= 0.9 * spec.proposed, (spec.accepted, spec.proposed)


def test_drafts_that_cannot_work_are_refused(folders, tmp_path):
    with pytest.raises(ValueError, match="would be the model again"):
        _compile(folders, "model")
    make_checkpoint(tmp_path / "wide", "llama", vocab_size=512, max_position_embeddings=MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="a draft must share the model's tokenizer"):
        runtime.compile_model(folders / "model", progress=False, max_seq_len=MAX_SEQ_LEN,
                              speculative={"method": "draft", "model": str(tmp_path / "wide")})


@pytest.mark.parametrize("which", ["copy", "other"])
def test_sampled_tokens_with_sampled_draft_guesses_are_distributed_as_the_model_samples(which, request):
    """A sampling request's guesses are drawn from the draft's distribution and checked with
    min(1, p / q): two sampled tokens (top-3), the second a checked guess whenever the draft
    guesses, against p(t1) · p(t2 | t1) over seeded draws. The copy keeps nearly every guess (q
    is p up to rounding), where a guess proposed with certainty would be kept with p(guess)
    alone; the other random model keeps fewer."""
    model = request.getfixturevalue(f"with_{which}")
    engine = always_checking(Engine(model))
    draws = 1200
    p_value = two_sampled_tokens_p_value(model, engine, looping_prompt(21, 30), SamplingParams(temperature=1.0, top_k=3),
                                         draws)
    spec = engine.speculator
    assert spec.checks >= draws
    assert p_value > P_VALUE_FLOOR
    kept = spec.accepted / spec.proposed
    if which == "copy":
        assert kept > 0.95, kept  # q is p up to rounding: min(1, p / q) keeps nearly all
    else:
        assert kept < 0.9, kept
