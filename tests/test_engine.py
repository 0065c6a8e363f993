"""The continuous-batching engine in process: chunk plans, text streams with stop strings, and
requests joining, leaving, failing and being cancelled while others run, with nothing recompiled
and every output what the request gives alone."""

import pytest

from helpers.graph_checks import no_recompiles
from qrt.runtime.engine import CANCELLED, ERROR, LENGTH, STOP, Engine, plan_chunks
from qrt.runtime.prefix_cache import PrefixCache
from qrt.runtime.sampling import SamplingParams
from qrt.runtime.text_stream import TextStream

SLOTS = 4  # chat_model's


@pytest.fixture
def model(chat_model):
    return chat_model


def alone(model, prompt, max_tokens, sampling=SamplingParams(), chunk=5):
    """The request's tokens with the engine to itself."""
    engine = Engine(model, chunk_size=chunk)
    seq = engine.submit(model.request(prompt, max_tokens, sampling, stop_at_eos=False))
    engine.run([seq])
    return seq.tokens


@pytest.mark.parametrize("length, chunk, plan", [
    (10, 4, [(0, 4), (4, 8), (8, 10)]),
    (9, 4, [(0, 4), (4, 7), (7, 9)]),  # no one-token chunk: the lone token joins the one before
    (4, 4, [(0, 4)]),
    (5, 4, [(0, 3), (3, 5)]),
    (1, 4, [(0, 1)]),
])
def test_prefill_chunks_cover_the_prompt_without_one_token_chunks(length, chunk, plan):
    assert plan_chunks(length, chunk) == plan


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_at_it(model):
    tokenizer = model.tokenizer
    stream = TextStream(tokenizer, ("lo w",))
    shown = [stream.add(i) for i in tokenizer.encode("hello world", add_special_tokens=False)]
    # Each "l", then "lo", "lo " may begin "lo w": held back until the text shows it does not;
    # "hello w" has it, so the text ends before it, and the rest of the input is not taken.
    assert shown == ["h", "e", "", "l", "", "", "", "", "", "", ""] and stream.stopped and stream.text == "hel"
    # A character of two bytes (two byte-level tokens) shows up whole, once complete.
    stream = TextStream(tokenizer)
    assert [stream.add(i) for i in tokenizer.encode("é!", add_special_tokens=False)] == ["", "é", "!"]
    assert stream.flush() == ""


def test_churn_of_requests_matches_each_alone_without_recompiles(model):
    prompts = [[7], [3, 4], [9, 10, 11], list(range(20, 27)), list(range(40, 52)), [5] * 5,
               list(range(60, 77)), [1, 2, 3, 4], list(range(100, 109))]
    max_tokens = [6, 11, 4, 9, 3, 14, 5, 8, 10]
    sampled = {2: SamplingParams(0.9, top_k=40, seed=11), 5: SamplingParams(1.0, top_p=0.8, seed=5)}
    params = [sampled.get(i, SamplingParams()) for i in range(len(prompts))]
    expected = [alone(model, p, n, s) for p, n, s in zip(prompts, max_tokens, params)]
    engine = Engine(model, chunk_size=5)
    with no_recompiles(model):
        sequences = [engine.submit(model.request(p, n, s, stop_at_eos=False))
                     for p, n, s in zip(prompts[:4], max_tokens, params)]
        engine.step()
        engine.step()
        for p, n, s in zip(prompts[4:], max_tokens[4:], params[4:]):  # later arrivals join running ones
            sequences.append(engine.submit(model.request(p, n, s, stop_at_eos=False)))
            engine.step()
        engine.run(sequences)
    assert [seq.tokens for seq in sequences] == expected
    assert all(seq.finish_reason == LENGTH for seq in sequences)
    assert not engine.has_work and engine.active == 0
    # The default chunk (the whole of these prompts at once) gives the same greedy tokens.
    assert model.generate(prompts[6], max_new_tokens=5, stop_at_eos=False) == expected[6]


def test_a_long_prompt_stalls_running_streams_by_one_chunk_at_most(model, monkeypatch):
    engine = Engine(model, chunk_size=8)
    running = engine.submit(model.request([5, 6, 7], 30, SamplingParams(), stop_at_eos=False))
    engine.step()
    prefilled = []
    real = model.prefill_chunk
    monkeypatch.setattr(model, "prefill_chunk", lambda tokens, *a: prefilled.append(len(tokens)) or real(tokens, *a))
    long = engine.submit(model.request(list(range(30, 90)), 4, SamplingParams(), stop_at_eos=False))
    while not long.tokens:
        before, prefilled[:] = len(running.tokens), []
        engine.step()
        assert sum(prefilled) <= 8, prefilled
        assert len(running.tokens) == before + 1  # the running stream got its token this step too
    engine.run([running, long])
    monkeypatch.undo()
    assert long.tokens == alone(model, list(range(30, 90)), 4, chunk=8)


def test_one_request_failing_leaves_the_others_untouched(model):
    engine = Engine(model, chunk_size=5)
    prompts = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    sequences = [engine.submit(model.request(p, 8, SamplingParams(), stop_at_eos=False, text=True)) for p in prompts]

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer fault")

    sequences[1].stream.add = broken
    # And one whose sampling fails (a generator multinomial cannot use).
    sampled = engine.submit(model.request([41, 42], 8, SamplingParams(1.0, seed=1), stop_at_eos=False))
    sampled.generator = object()
    engine.run(sequences + [sampled])
    assert sequences[1].finish_reason == ERROR and isinstance(sequences[1].error, UnicodeDecodeError)
    assert sampled.finish_reason == ERROR and isinstance(sampled.error, TypeError)
    assert [sequences[0].tokens, sequences[2].tokens] == [alone(model, prompts[0], 8), alone(model, prompts[2], 8)]
    assert engine.active == 0


def test_a_cancelled_request_frees_its_slot_at_the_next_step(model):
    engine = Engine(model, chunk_size=5)
    sequences = [engine.submit(model.request([i + 1, i + 2], 40, SamplingParams(), stop_at_eos=False))
                 for i in range(SLOTS + 1)]
    engine.step()
    assert engine.active == SLOTS and len(engine.waiting) == 1
    sequences[0].cancel()
    engine.step()
    assert sequences[0].finish_reason == CANCELLED and sequences[3].slot is not None and not engine.waiting
    for seq in sequences:
        seq.cancel()
    engine.step()
    assert engine.active == 0 and not engine.has_work


def test_stop_strings_and_stop_ids_end_a_request(model):
    free = model.generate("abc", max_new_tokens=12, stop_at_eos=False)
    ids = alone(model, model.encode("abc"), 12, chunk=256)
    # Two characters from the middle of the output, each one or more byte-level tokens: the stop
    # string spans token boundaries.
    start = next(i for i in range(1, len(free) - 1) if "\ufffd" not in free[i:i + 2])
    stop = free[start:start + 2]
    assert model.generate("abc", max_new_tokens=12, stop_at_eos=False, stop=[stop]) == free[:free.index(stop)]
    engine = model.engine
    seq = engine.submit(model.request(model.encode("abc"), 12, SamplingParams(), stop_at_eos=False,
                                      stop_ids=[ids[4]]))
    engine.run([seq])
    assert seq.tokens == ids[:ids.index(ids[4]) + 1] and seq.finish_reason == STOP


def test_whole_chunks_a_free_slot_holds_are_not_prefilled_again_and_change_nothing(model):
    """A prompt that starts with whole prefill chunks of one that ran before skips them (its
    slot still holds their keys and values) and gets what a cold engine gives, bit for bit:
    tokens and log-probabilities. A prompt that differs inside a chunk reuses the chunks before
    it; one whose prompt is scored reuses nothing."""
    system = list(range(30, 52))  # 22 tokens: with chunks of 5, four whole chunks and two tokens
    prompts = [system + [60, 61, 62], system + [70, 71], system[:12] + [99] + system[13:] + [70, 71]]

    def run(engine, prompt, **scoring):
        seq = engine.submit(model.request(prompt, 6, SamplingParams(), stop_at_eos=False, logprobs=2, **scoring))
        engine.run([seq])
        return seq

    def same(a, b):
        return a.tokens == b.tokens and a.logprobs == b.logprobs

    model.prefix_cache.clear()  # what earlier tests left in the shared model's slots
    engine = Engine(model, chunk_size=5)
    with no_recompiles(model):
        before = engine.prefix_cache.reused_tokens
        run(engine, prompts[0])
        assert engine.prefix_cache.reused_tokens == before
        for prompt, reused in ((prompts[1], 20), (prompts[2], 10)):
            before = engine.prefix_cache.reused_tokens
            warm = run(engine, prompt)
            assert engine.prefix_cache.reused_tokens - before == reused  # chunks [0, 20) then [0, 10)
            assert same(warm, run(Engine(model, chunk_size=5, prefix_caching=False), prompt))
        before = engine.prefix_cache.reused_tokens
        scored = run(engine, prompts[1], prompt_logprobs=1)
        assert engine.prefix_cache.reused_tokens == before and len(scored.prompt_logprobs) == len(prompts[1])


def test_the_prefix_cache_keeps_whole_chunks_from_zero_and_drops_what_a_write_covers():
    cache = PrefixCache(2)
    for start, tokens in ((0, [1, 2, 3]), (3, [4, 5, 6]), (6, [7, 8])):  # the last chunk is partial: not kept
        cache.extend(0, start, tokens, 3)
    assert cache.content[0].tokens == (1, 2, 3, 4, 5, 6)
    starts = [start for start, _ in plan_chunks(8, 3)]  # 0, 3, 6
    assert cache.reusable(0, [1, 2, 3, 4, 5, 6, 9, 9], starts, 3) == 6
    assert cache.reusable(0, [1, 2, 3, 4, 0, 6, 9, 9], starts, 3) == 3  # differs inside the second chunk
    assert cache.reusable(0, [1, 2, 3, 4, 5, 6, 9, 9], starts, 4) == 0  # held in chunks of another size
    assert cache.reusable(0, [1, 2, 3, 4, 5, 6], [0, 3], 3) == 3  # the prompt's last chunk always runs
    # 7 tokens plan as (0, 3), (3, 5), (5, 7): the chunk from 3 is not a whole one, so only 3 are reused
    assert cache.reusable(0, [1, 2, 3, 4, 5, 6, 9], [start for start, _ in plan_chunks(7, 3)], 3) == 3
    cache.freed(1)
    cache.freed(0)
    assert cache.choose([0, 1], [7, 7, 7, 7], [0, 3], 3) == (1, 0)  # nothing to reuse: the slot freed longest ago
    assert cache.choose([0, 1], [1, 2, 3, 4, 5, 6, 9], [0, 3, 6], 3) == (0, 6)
    cache.overwritten(0, 4)  # a write from position 4 on leaves the first whole chunk
    assert cache.reusable(0, [1, 2, 3, 4, 5, 6, 9, 9], starts, 3) == 3


def test_a_write_into_a_slot_outside_the_engine_drops_what_it_held(model):
    model.prefix_cache.clear()
    engine = Engine(model, chunk_size=5)
    seq = engine.submit(model.request(list(range(30, 52)), 2, SamplingParams(), stop_at_eos=False))
    engine.run([seq])
    (slot,) = [slot for slot, held in enumerate(model.prefix_cache.content) if held.tokens]
    assert len(model.prefix_cache.content[slot].tokens) == 20
    model.prefill_chunk([1, 2, 3], 5, slot)
    assert model.prefix_cache.content[slot].tokens == tuple(range(30, 35))
