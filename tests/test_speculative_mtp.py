"""Speculative method "mtp": a tiny DeepSeek-V3 checkpoint with one multi-token-prediction layer in
DeepSeek's layout, the layer trained on the model's own greedy text (helpers/checkpoints/mtp.py).
transformers' MtpModel, reading the same file, is the reference: qrt's layer gives its logits and
the engine's first guess at every step is its argmax there. Greedy tokens are those of plain
decoding, alone and in a churn over several slots, eagerly and compiled (one graph per role, no
recompiles as acceptance varies; in bf16 the verify call's logits are the decode step's bit for
bit, experts included); sampled tokens keep the model's distribution; models without
the layer are refused with what to do; `qrt serve --speculative mtp` answers the openai client as
plain decoding does."""

import json
import random
import sys

import openai
import pytest
import torch

from bench.serve_load import ServerProcess, free_port, metrics
from helpers.checkpoints.mtp import make_mtp_checkpoint, train_mtp_layer, training_prompts, transformers_mtp
from helpers.checkpoints.tiny import make_checkpoint
from helpers.compare import relative_l2
from helpers.graph_checks import no_recompiles
from helpers.speculation import (P_VALUE_FLOOR, always_checking, run_requests, two_sampled_tokens_p_value,
                                 verify_beside_decode)
from qrt import runtime
from qrt.errors import UnsupportedError
from qrt.runtime.engine import Engine
from qrt.runtime.sampling import SamplingParams
from tiny_tokenizer import write_tokenizer

pytestmark = pytest.mark.runs_first  # its bf16 checks take minutes on a CPU without bf16 arithmetic

K, SLOTS, MAX_SEQ_LEN, VOCAB = 3, 3, 128, 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    make_mtp_checkpoint(folder)
    # The layer predicts every training token after it trains (measured: all of them); a layer that
    # did not learn would leave the kept-guess checks below nothing to keep.
    assert train_mtp_layer(folder) > 0.9
    write_tokenizer(folder)  # for the server's text
    return folder


def _compile(folder, compile: bool):
    return runtime.compile_model(folder, compile=compile, progress=False, max_seq_len=MAX_SEQ_LEN,
                                 max_batch_size=SLOTS, speculative={"method": "mtp", "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def eager(folder):
    return _compile(folder, compile=False)


def _requests(model):
    """Continuations of three training prompts (the layer guesses them well) and of an unseen
    17-token prompt (it guesses worse), one of them of a one-token prompt."""
    prompts = training_prompts(VOCAB)[:3] + [[random.Random(4).randrange(VOCAB) for _ in range(17)]]
    prompts[1] = prompts[1][:1]
    return [model.request(prompt, new, SamplingParams(), stop_at_eos=False)
            for prompt, new in zip(prompts, (40, 30, 44, 36))]


def _recording_first_guesses(engine: Engine) -> dict:
    """Wrap the engine's guessing: (position fed, first guess) of each step, by id(request)."""
    first, guesses = {}, engine.speculator.guesses

    def recording(rows):
        made = guesses(rows)
        for seq, context, _ in rows:
            if made.get(id(seq)):
                first.setdefault(id(seq.request), []).append((len(context) - 1, made[id(seq)][0]))
        return made

    engine.speculator.guesses = recording
    return first


def test_the_layer_gives_transformers_mtp_logits(folder, eager):
    """The model's final hidden states and the tokens after them through qrt's layer (eager,
    float32) against transformers' MtpModel reading the same file."""
    hf, mtp = transformers_mtp(folder)
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states[-1]  # [1, 20, D], normed
        # transformers places the pair (h_i, token i + 1) at position i + 1, qrt at i: RoPE sees
        # the same distances.
        expected = mtp._project_to_logits(mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, 20)[None], None,
                                                            input_ids=ids[:, 1:]))
        slot = torch.tensor([0])  # [1]: the cache row of this one sequence
        _, own_hidden = eager.model(ids, torch.arange(20)[None], torch.arange(20), slot, keep_hidden=True)
        got, _ = eager.model.predict(ids[:, 1:], own_hidden[:, :-1], torch.arange(19)[None], torch.arange(19), slot)
    assert relative_l2(own_hidden, hidden) < 1e-4  # measured: 1.3e-5
    assert relative_l2(got, expected) < 1e-4  # measured: 1.1e-5, float32 rounding through two models


def _first_guesses_are_transformers_argmaxes(folder, requests, tokens, first):
    hf, mtp = transformers_mtp(folder)
    checked = 0
    for request, output in zip(requests, tokens):
        ids = torch.tensor([list(request.prompt) + output])
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states[-1]
            length = ids.shape[1]
            logits = mtp._project_to_logits(mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, length)[None], None,
                                                              input_ids=ids[:, 1:]))[0]  # [L - 1, V]
        for position, guess in first.get(id(request), []):
            # The step feeding the token at `position` guesses from the pair (h at position - 1, it).
            assert guess == int(logits[position - 1].argmax()), (position, guess)
            checked += 1
    assert checked >= 20


def test_greedy_tokens_equal_plain_decoding_and_first_guesses_are_the_layers(folder, eager):
    requests = _requests(eager)
    alone = [run_requests(Engine(eager, speculate=False), [r])[0] for r in requests]
    speculating = always_checking(Engine(eager))
    first = _recording_first_guesses(speculating)
    assert [run_requests(speculating, [r])[0] for r in requests] == alone
    assert run_requests(speculating, requests, arrivals=[0, 1, 4, 6]) == alone
    spec = speculating.speculator
    # Measured 41% of 3 guesses a check: the first guesses nearly all kept, the chained ones less.
    assert spec.checks > 0 and 0.25 * spec.proposed < spec.accepted < spec.proposed, (spec.accepted, spec.proposed)
    _first_guesses_are_transformers_argmaxes(folder, requests, alone, first)


def test_models_without_the_layer_are_refused(folder, tmp_path):
    make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(UnsupportedError, match="no multi-token-prediction layers"):
        runtime.compile_model(tmp_path / "llama", compile=False, progress=False, speculative={"method": "mtp"})
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "none").mkdir()
    for name in ("model.safetensors",):
        (tmp_path / "none" / name).symlink_to(folder / name)
    (tmp_path / "none" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UnsupportedError, match="num_nextn_predict_layers is 0"):
        runtime.compile_model(tmp_path / "none", compile=False, progress=False, speculative={"method": "mtp"})


@pytest.fixture(scope="module")
def compiled(folder):
    return _compile(folder, compile=True)


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_plain_decoding_without_recompiles(folder, compiled):
    requests = _requests(compiled)
    alone = [run_requests(Engine(compiled, speculate=False), [r])[0] for r in requests]
    speculating = always_checking(Engine(compiled))
    first = _recording_first_guesses(speculating)
    with no_recompiles(compiled):
        assert [run_requests(speculating, [r])[0] for r in requests] == alone
        assert run_requests(speculating, requests, arrivals=[0, 1, 4, 6]) == alone
    spec = speculating.speculator
    assert 0.25 * spec.proposed < spec.accepted < spec.proposed, (spec.accepted, spec.proposed)
    _first_guesses_are_transformers_argmaxes(folder, requests, alone, first)
    assert compiled.mtp.compile_report() == {"catch_up": 1, "chain": 1}
    assert {role: count for role, count in compiled.compile_report().items() if count} == {
        "prefill": 1, "decode": 1, "decode_slot": 1, "verify": 1, "verify_slot": 1}


@pytest.mark.slow
def test_sampled_tokens_with_the_layers_guesses_are_distributed_as_the_model_samples(compiled):
    """Two sampled tokens (temperature 1, top-3) after a training prompt, the second a checked
    guess drawn from the layer's distribution, against p(t1) · p(t2 | t1) over seeded draws."""
    engine = always_checking(Engine(compiled))
    draws = 1200
    p_value = two_sampled_tokens_p_value(compiled, engine, training_prompts(VOCAB)[0],
                                         SamplingParams(temperature=1.0, top_k=3), draws)
    assert engine.speculator.checks >= draws
    assert p_value > P_VALUE_FLOOR


@pytest.mark.slow
def test_the_server_answers_as_plain_decoding_and_counts_the_layers_guesses(folder, compiled, tmp_path):
    """`qrt serve --speculative mtp` on the same checkpoint (its model graphs from the compile cache
    the fixture filled): greedy completions of token prompts, alone and streamed, are the text plain
    decoding gives, and /metrics counts guesses kept."""
    port = free_port()
    command = [sys.executable, "-m", "qrt", "serve", str(folder), "--port", str(port), "--max-batch", str(SLOTS),
               "--max-seq-len", str(MAX_SEQ_LEN), "--speculative", "mtp", "--num-speculative-tokens", str(K),
               "--served-model-name", "x"]
    server = ServerProcess(command, port, "/health", tmp_path / "server.log")
    prompts = training_prompts(VOCAB)[:3]
    expected = []
    for prompt in prompts:
        engine = Engine(compiled, speculate=False)
        seq = engine.submit(compiled.request(prompt, 30, SamplingParams(), stop_at_eos=False, text=True))
        engine.run([seq])
        expected.append(seq.text)
    try:
        server.wait_ready(300)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        answers = [client.completions.create(model="x", prompt=prompt, max_tokens=30, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for prompt in prompts]
        stream = client.completions.create(model="x", prompt=prompts[0], max_tokens=30, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        values = metrics(server.url)
    finally:
        server.stop()
    assert all(expected) and answers == expected and streamed == expected[0]
    assert 0 < values["qrt_speculative_accepted_tokens_total"] <= values["qrt_speculative_proposed_tokens_total"]


@pytest.mark.slow
def test_in_bf16_the_verify_logits_are_the_decode_logits_bit_for_bit(tmp_path):
    """bf16, where rounding could flip a near-tie: on this mixture-of-experts model (latent
    attention, experts choosing per token) each place of a verify call scores exactly what a decode
    step feeding its token does, in every slot, so greedy tokens are unchanged with the layer's
    guesses (measured: 240 of 240 places equal over 60 prompts with
    `python -m bench.probes.mtp_verify_trials 60`)."""
    make_mtp_checkpoint(tmp_path, dtype=torch.bfloat16)
    train_mtp_layer(tmp_path)
    model = runtime.compile_model(tmp_path, progress=False, max_seq_len=MAX_SEQ_LEN, max_batch_size=SLOTS,
                                  speculative={"method": "mtp", "num_speculative_tokens": K})
    assert model.model.lm_head.weight.dtype == torch.bfloat16
    for trial in range(6):
        generator = torch.Generator().manual_seed(trial)
        prompt = torch.randint(0, VOCAB, (5 + 17 * trial,), generator=generator).tolist()
        verified, decoded, _, _ = verify_beside_decode(model, prompt, trial % SLOTS, K)
        for place in range(K + 1):
            assert torch.equal(verified[place], decoded[place]), (trial, place)
    requests = _requests(model)
    alone = [run_requests(Engine(model, speculate=False), [r])[0] for r in requests]
    speculating = always_checking(Engine(model))
    assert run_requests(speculating, requests, arrivals=[0, 1, 4, 6]) == alone
    assert speculating.speculator.accepted > 0
