"""The decode step without Dynamo (qrt/runtime/direct_graph.py): the same logits as the step
through Dynamo and its guards, and qrt's own refusal where the guards would have needed another
graph."""

import pytest
import torch

from helpers.graph_checks import no_recompiles


class CountingCalls:
    """Stands in for a compiled function and counts the calls that reach it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def _greedy_logits(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Each decode step's logits [V] after prefilling `prompt` into slot 0, fed greedily."""
    logits = model.prefill(torch.tensor([prompt]))  # [1, 1, V]
    out = []
    for step in range(steps):
        logits = model.decode(logits[:, -1].argmax(-1).view(1, 1), len(prompt) + step)
        out.append(logits[0, 0].clone())
    return out


def test_decode_skips_dynamo_and_gives_the_guarded_steps_logits(compiled, llama_dir):
    model = compiled(llama_dir)
    assert model.direct_decode is not None, "the warmed-up decode graph was not captured"
    counting = CountingCalls(model.graph_functions["decode"])
    model.graph_functions["decode"] = counting
    # A model whose decode graph came from the compile cache (the session's `compiled` models are
    # rebuilt after a test resets Dynamo, and then load what an earlier build stored) is traced
    # once on entering `guarded`: one more call through Dynamo.
    tracing_call = int("decode" in model.loaded_roles)
    try:
        direct = _greedy_logits(model, list(range(30, 41)), 12)
        assert counting.calls == 0
        with no_recompiles(model):
            guarded = _greedy_logits(model, list(range(30, 41)), 12)
        assert counting.calls == 12 + tracing_call
    finally:
        model.graph_functions["decode"] = counting.fn
    for step, (a, b) in enumerate(zip(direct, guarded)):
        assert torch.equal(a, b), f"step {step}: direct and guarded logits differ by {(a - b).abs().max()}"


def test_direct_decode_refuses_what_the_graph_was_not_compiled_for(compiled, llama_dir):
    model = compiled(llama_dir)
    tokens, positions = model._slot0_step(5, 3)
    with pytest.raises(ValueError, match=r"attended length 128 is outside the range \[2, 127\]"):
        model.decode_step(tokens, positions, model.max_seq_len)
    with pytest.raises(ValueError, match=r"input 'input_ids' is torch.int32 \[1, 1\].*compiled for torch.int64"):
        model.decode_step(tokens.int(), positions, 4)
    # Through Dynamo the same int32 step would have needed a graph of its own.
    with pytest.raises(RuntimeError, match="fail_on_recompile|Detected recompile"), no_recompiles(model):
        model.decode_step(tokens.int(), positions, 4)


def test_prefill_skips_dynamo_and_gives_the_guarded_prefills_logits(compiled, llama_dir):
    model = compiled(llama_dir)
    assert "prefill" in model.direct, "the warmed-up prefill graph was not captured"
    counting = CountingCalls(model.graph_functions["prefill"])
    model.graph_functions["prefill"] = counting
    try:
        # Chunks of other lengths at other offsets: both of the graph's sizes vary.
        chunks = [(list(range(20, 29)), 0), (list(range(40, 43)), 9)]
        direct = [model.prefill_chunk(tokens, start, 0, with_hidden=True) for tokens, start in chunks]
        assert counting.calls == 0
        with no_recompiles(model):
            guarded = [model.prefill_chunk(tokens, start, 0, with_hidden=True) for tokens, start in chunks]
        assert counting.calls == 2
    finally:
        model.graph_functions["prefill"] = counting.fn
    for (logits, hidden), (want_logits, want_hidden) in zip(direct, guarded):
        assert torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)


def test_direct_prefill_refuses_sizes_outside_its_ranges(compiled, llama_dir):
    model = compiled(llama_dir)
    with pytest.raises(ValueError, match=r"prefill step: attended length 128 is outside the range \[2, 127\]"):
        model.prefill_chunk(list(range(10, 20)), model.max_seq_len - 10, 0)
