"""Log-probabilities from the engine: of a prompt's own tokens (scored in the prefill chunks it runs
anyway) and of generated tokens, against transformers' float32 logits on the same checkpoint."""

import pytest
import torch

from qrt.runtime.engine import LENGTH, Engine
from qrt.runtime.sampling import SamplingParams

# float32 on both sides: the logits differ by the order of their sums (~1e-6 relative), which
# moves a log-probability by far less than this.
CLOSE = 1e-3
PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 120, 64, 33, 2, 18]


@pytest.fixture
def reference(chat_llama_dir, hf_model):
    """transformers' log-probabilities [T, V] at every position of `ids`."""
    hf = hf_model(chat_llama_dir)

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def run(model, request, chunk):
    engine = Engine(model, chunk_size=chunk)
    seq = engine.submit(request)
    engine.run([seq])
    assert seq.error is None, seq.error
    return seq


@pytest.mark.parametrize("chunk", [4, 256])  # the prompt in four chunks, and in one
def test_a_prompt_scored_alone_matches_transformers(chat_model, reference, chunk):
    request = chat_model.request(PROMPT, 0, SamplingParams(), prompt_logprobs=3)
    seq = run(chat_model, request, chunk)
    assert seq.finish_reason == LENGTH and seq.tokens == []
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(PROMPT)
    expected = reference(PROMPT)
    for position, scored in enumerate(seq.prompt_logprobs[1:], start=1):
        assert scored.token == PROMPT[position]
        assert abs(scored.logprob - expected[position - 1, PROMPT[position]].item()) < CLOSE, position
        values, ids = expected[position - 1].topk(3)
        assert [token for token, _ in scored.top] == ids.tolist(), position
        assert max(abs(a - b) for (_, a), b in zip(scored.top, values.tolist())) < CLOSE


def test_generated_tokens_are_scored_before_temperature(chat_model, reference):
    # Sampled at temperature 1.5 and top_k 5; the reported log-probabilities are the model's own.
    request = chat_model.request(PROMPT, 6, SamplingParams(temperature=1.5, top_k=5, seed=1), stop_at_eos=False,
                                 logprobs=2, prompt_logprobs=0)
    seq = run(chat_model, request, 5)
    expected = reference(PROMPT + seq.tokens)
    assert [scored.token for scored in seq.logprobs] == seq.tokens
    for step, scored in enumerate(seq.logprobs):
        row = expected[len(PROMPT) - 1 + step]
        assert abs(scored.logprob - row[scored.token].item()) < CLOSE, step
        assert [token for token, _ in scored.top] == row.topk(2).indices.tolist()
    assert all(scored.top == () for scored in seq.prompt_logprobs[1:])


def test_greedy_tokens_are_the_top_alternative_and_scoring_changes_no_token(chat_model):
    plain = run(chat_model, chat_model.request(PROMPT, 8, SamplingParams(), stop_at_eos=False), 4)
    scored = run(chat_model, chat_model.request(PROMPT, 8, SamplingParams(), stop_at_eos=False, logprobs=1,
                                                prompt_logprobs=1), 4)
    assert scored.tokens == plain.tokens
    assert all(s.top[0] == (s.token, s.logprob) for s in scored.logprobs)


def test_scoring_compiles_no_other_graph(chat_model):
    before = chat_model.compile_report()
    run(chat_model, chat_model.request(PROMPT, 2, SamplingParams(), logprobs=5, prompt_logprobs=5), 4)
    assert chat_model.compile_report() == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), r"max_new_tokens must be an integer >= 1.*0 only when the prompt is scored"),
    (dict(max_tokens=1, logprobs=21), r"logprobs must be an integer from 0 to 20"),
    (dict(max_tokens=1, prompt_logprobs=-1), r"prompt_logprobs must be an integer from 0 to 20"),
])
def test_bad_requests_are_refused(chat_model, kwargs, message):
    max_tokens = kwargs.pop("max_tokens")
    with pytest.raises(ValueError, match=message):
        chat_model.request(PROMPT, max_tokens, SamplingParams(), **kwargs)


# ---- a request's own adjustments of the logits -------------------------------------------------
def adjusted_by_definition(logits: list[float], params: SamplingParams, prompt, output, stops) -> list[float]:
    """The adjustments as vLLM documents them, one token at a time in plain Python."""
    values = list(logits)
    for token, bias in params.logit_bias:
        values[token] += bias
    if len(output) < params.min_tokens:
        for token in stops:
            values[token] = float("-inf")
    for token in set(prompt) | set(output):
        r = params.repetition_penalty
        values[token] = values[token] / r if values[token] > 0 else values[token] * r
    for token in set(output):
        values[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return values


PENALIZED = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                           logit_bias=((65, 4.0), (66, -3.0)), min_tokens=4)


def test_penalties_bias_and_min_tokens_give_the_greedy_tokens_of_their_definition(chat_model, chat_llama_dir,
                                                                                   hf_model):
    hf = hf_model(chat_llama_dir)
    stops = sorted(chat_model.eos_ids) + [PROMPT[2]]
    request = chat_model.request(PROMPT, 10, PENALIZED, stop_ids=[PROMPT[2]], logprobs=0)
    seq = run(chat_model, request, 5)
    output = []
    while len(output) < len(seq.tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + output])).logits[0, -1].float().tolist()
        values = adjusted_by_definition(logits, PENALIZED, PROMPT, output, stops)
        output.append(max(range(len(values)), key=values.__getitem__))
    assert seq.tokens == output
    # The reported log-probabilities stay the model's own, before the adjustments.
    plain = reference_logprobs(hf, PROMPT + output)
    assert max(abs(s.logprob - plain[len(PROMPT) - 1 + i, s.token].item()) for i, s in enumerate(seq.logprobs)) < CLOSE


def test_the_adjustments_change_the_greedy_tokens(chat_model):
    # So that the test above cannot pass with the adjustments ignored.
    plain = run(chat_model, chat_model.request(PROMPT, 10, SamplingParams(), stop_at_eos=False), 5)
    penalized = run(chat_model, chat_model.request(PROMPT, 10, PENALIZED, stop_at_eos=False), 5)
    assert plain.tokens != penalized.tokens


def reference_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
