"""Speculative decoding by prompt lookup: the guesses, the verify graph against the decode graph,
greedy tokens unchanged at batch 1 and in a churn of requests, sampled tokens distributed as the
model's own, and one verify graph however many guesses are kept."""

import random

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint
from helpers.graph_checks import assert_no_graph_breaks, no_recompiles
from helpers.speculation import (P_VALUE_FLOOR, always_checking, chi_square_p, looping_prompt, run_requests,
                                 two_sampled_tokens_p_value)
from qrt import runtime
from qrt.runtime.engine import Engine
from qrt.runtime.sampling import SamplingParams, check_guess, probabilities
from qrt.runtime.speculative import CheckCosts, SpeculativeConfig, prompt_lookup

K = 3
MAX_SEQ_LEN = 640


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama (float32) with three slots, speculating k = 3 tokens by prompt lookup."""
    folder = tmp_path_factory.mktemp("tiny-llama-long")
    make_checkpoint(folder, "llama", max_position_embeddings=MAX_SEQ_LEN)
    return runtime.compile_model(folder, progress=False, max_seq_len=MAX_SEQ_LEN, max_batch_size=3,
                                 speculative={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1})


def plain_lookup(context, limit, longest, shortest):
    """prompt_lookup's rule, spelled out: for n from longest down, of the earlier occurrences of
    the last n tokens (latest first), the first followed by `limit` tokens, else the one followed
    by the most."""
    for n in range(min(longest, len(context) - 1), shortest - 1, -1):
        tail, best = context[-n:], []
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                follows = context[start + n:start + n + limit]
                if len(follows) == limit:
                    return follows
                if len(follows) > len(best):
                    best = follows
        if best:
            return best
    return []


def test_prompt_lookup_matches_a_plain_search():
    rng = random.Random(0)
    # Ids whose 4-byte words share bytes (256 = 00 01 00 00, 1 = 01 00 00 00, ...), so that byte
    # matches across token boundaries occur and must be skipped.
    alphabet = [0, 1, 256, 65536, 257, 65792, 7]
    found = 0
    for _ in range(3000):
        context = [rng.choice(alphabet[:rng.randint(2, len(alphabet))]) for _ in range(rng.randint(1, 40))]
        limit, shortest = rng.randint(1, 6), rng.randint(1, 3)
        longest = rng.randint(shortest, 5)
        expected = plain_lookup(context, limit, longest, shortest)
        assert prompt_lookup(context, limit, longest, shortest) == expected, (context, limit, longest, shortest)
        found += bool(expected)
    assert found > 1000  # most contexts have something to look up


def test_speculative_settings_are_checked():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"method": "ngram"}).width == 4
    assert SpeculativeConfig.parse({"model": "/m", "quant": "int4"}).method == "draft"  # vLLM's form
    for bad, says in (({"num_speculative_tokens": 3}, "needs a 'method'"),
                      ({"method": "ngram", "model": "/m"}, "need method 'draft'"),
                      ({"method": "eagle"}, "not supported"),
                      ({"method": "ngram", "lookahead": 2}, "unknown setting"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                      ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "above prompt_lookup_max"),
                      ("ngram", "must be a dict")):
        with pytest.raises(ValueError, match=says):
            SpeculativeConfig.parse(bad)


def test_verify_logits_equal_decode_logits(model):
    """Place t of a verify call scores what a decode step feeding that token scores. This float32
    model's matmuls are ATen's, whose sums depend on the row count, so to rounding; qrt's own
    kernels give the same bits at every row count (test_speculative_default_model.py)."""
    prompt = list(range(20, 60))
    fed = [7, 11, 13, 17]  # the next token and three guesses
    logits = model.prefill_chunk(prompt, 0, 1)
    assert logits.shape == (model.vocab_size,)
    decoded = []
    for place, token in enumerate(fed):
        tokens, positions = model.idle_decode_rows()
        tokens[1], positions[1] = token, len(prompt) + place
        decoded.append(model.decode_step(tokens, positions, len(prompt) + place + 1)[1])
    tokens, positions = model.idle_rows(K + 1)
    tokens[1], positions[1] = torch.tensor(fed), torch.arange(len(prompt), len(prompt) + K + 1)
    verified = model.verify_step(tokens, positions, len(prompt) + K + 1)  # [slots, k + 1, V]
    assert verified.shape == (3, K + 1, model.vocab_size)
    for place in range(K + 1):
        torch.testing.assert_close(verified[1, place], decoded[place], rtol=1e-5, atol=1e-5, msg=f"place {place}")


def test_greedy_tokens_equal_plain_decoding_at_batch_1(model):
    prompt = looping_prompt(1, 40)
    request = model.request(prompt, 60, SamplingParams(), stop_at_eos=False)
    speculating = always_checking(Engine(model))
    assert run_requests(speculating, [request]) == run_requests(Engine(model, speculate=False), [request])
    spec = speculating.speculator
    assert spec.checks > 0 and 0 < spec.accepted <= spec.proposed


def test_greedy_tokens_equal_plain_decoding_in_a_churn(model):
    """Five requests over three slots, of different lengths, arriving at different steps, some
    sampling: each greedy one's tokens are the tokens it gets alone without speculation."""
    requests = [model.request(looping_prompt(seed, length), new, sampling, stop_at_eos=False)
                for seed, length, new, sampling in (
                    (2, 30, 50, SamplingParams()), (3, 9, 40, SamplingParams(temperature=0.9, seed=5)),
                    (4, 70, 45, SamplingParams()), (5, 3, 30, SamplingParams()),
                    (6, 50, 35, SamplingParams(temperature=1.2, top_k=5, seed=2)))]
    alone = [run_requests(Engine(model, speculate=False), [r])[0] for r in requests]
    speculating = always_checking(Engine(model))
    together = run_requests(speculating, requests, arrivals=[0, 0, 2, 5, 9])
    for i, request in enumerate(requests):
        assert len(together[i]) == request.max_tokens
        if request.sampling.greedy:
            assert together[i] == alone[i], f"request {i}"
    assert speculating.speculator.accepted > 0


def test_one_verify_graph_however_many_guesses_are_kept(model):
    requests = [model.request(looping_prompt(seed, 25), 40, SamplingParams(), stop_at_eos=False) for seed in (7, 8)]
    engine = always_checking(Engine(model))
    with no_recompiles(model):
        run_requests(engine, requests, arrivals=[0, 3])
    spec = engine.speculator
    assert spec.checks > 1 and 0 < spec.accepted < spec.proposed  # guesses kept and guesses refused
    assert model.compile_report()["verify"] == 1
    assert_no_graph_breaks(model, "verify")


def test_a_checked_guess_is_distributed_as_the_model_samples():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=generator) * 1.5
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
                   SamplingParams(temperature=1.3, top_p=0.7)):
        p = probabilities(logits[None], params)[0]
        for guess in (int(p.argmax()), int(p.argmin())):  # a likely guess and one never right
            draws = [check_guess(logits, params, generator, guess) for _ in range(4000)]
            counts = torch.bincount(torch.tensor([token for token, _ in draws]), minlength=12).double()
            assert chi_square_p(counts, p.double() * len(draws)) > P_VALUE_FLOOR, (params, guess)
            assert all(agreed == (token == guess) for token, agreed in draws)


def test_a_guess_drawn_from_a_proposal_is_checked_into_the_models_distribution():
    """Guesses drawn from another distribution q (a draft's), checked with min(1, p / q) and the
    residual max(0, p - q): the tokens are distributed as p, and a guess is kept as often as
    the two distributions overlap (the sum of min(p, q)). The rule for a guess proposed with
    certainty also gives p whatever the guesses, but keeps them with the sum of p·q (0.09–0.23
    here, against 0.52–0.68): the rate kept is what tells the rules apart."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(12, generator=generator) * 1.5
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
                   SamplingParams(temperature=1.3, top_p=0.7)):
        p = probabilities(logits[None], params)[0]
        q = probabilities((logits + torch.randn(12, generator=generator))[None], SamplingParams(temperature=1.0))[0]
        draws = []
        for _ in range(4000):
            guess = int(torch.multinomial(q, 1, generator=generator))
            draws.append(check_guess(logits, params, generator, guess, proposal=q))
        counts = torch.bincount(torch.tensor([token for token, _ in draws]), minlength=12).double()
        assert chi_square_p(counts, p.double() * len(draws)) > P_VALUE_FLOOR, params
        kept = sum(agreed for _, agreed in draws) / len(draws)
        overlap = float(torch.minimum(p, q).sum())
        assert abs(kept - overlap) < 4 * (overlap * (1 - overlap) / len(draws)) ** 0.5 + 1e-3, (kept, overlap)


@pytest.mark.slow  # 1500 seeded requests: `make test-slow`
def test_sampled_tokens_through_the_engine_are_distributed_as_the_model_samples(model):
    """Two sampled tokens (top-3 of a random model), the second always a checked guess: their
    joint frequencies over seeded draws against p(t1) · p(t2 | t1). The guess after each t1 is
    the model's most likely t2 (looked up beforehand), so that it is kept often and refused often;
    a lookup in this random model's text would almost never be right."""
    prompt = looping_prompt(9, 40)
    params = SamplingParams(temperature=1.0, top_k=3)
    with torch.no_grad():
        following = {a: model(torch.tensor([prompt + [a]]))[0, -1] for a in range(model.vocab_size)}
    likeliest = {a: int(logits.argmax()) for a, logits in following.items()}
    engine = always_checking(Engine(model))
    engine.speculator.guess = lambda state, context, limit: [likeliest[context[-1]]]
    draws = 1500
    assert two_sampled_tokens_p_value(model, engine, prompt, params, draws) > P_VALUE_FLOOR
    spec = engine.speculator
    assert spec.checks >= draws  # every second token came from a check (and some third ones)
    assert draws / 10 < spec.accepted < spec.proposed - draws / 10, spec.accepted  # guesses kept and refused


def test_a_check_runs_where_it_is_expected_to_pay():
    costs = CheckCosts()
    assert costs.pays("decode", "verify", 2, [3, 3], 0.5)  # nothing measured yet: check, to measure it
    costs.observe("decode", 0.010)
    costs.observe("verify", 0.026)
    # 2 rows, 3 guesses each, a third of guesses kept: 2 tokens a row in 26 ms against 1 in 10 ms.
    assert not costs.pays("decode", "verify", 2, [3, 3], 1 / 3)
    assert costs.pays("decode", "verify", 2, [3, 3], 0.9)  # 3.7 tokens a row: it pays
    assert costs.pays("decode_slot", "verify_slot", 1, [3], 0.5)  # another pair of graphs, unmeasured
    for _ in range(CheckCosts.PROBE_EVERY):
        assert not costs.pays("decode", "verify", 2, [3, 3], 1 / 3)
    assert costs.pays("decode", "verify", 2, [3, 3], 1 / 3)  # measured again now and then
    costs.observe("verify", 0.012)  # cheaper now: the running average moves a fifth of the way
    assert abs(costs.seconds["verify"] - 0.0232) < 1e-9
