"""`qrt serve --speculative ngram` as clients see it: the openai client's greedy completions,
whole and streamed, alone and four at once, are what the same model gives without speculation,
and /metrics counts the guesses checked and kept."""

import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from bench.serve_load import ServerProcess, free_port, metrics
from qrt.runtime.engine import Engine
from qrt.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow  # a server process compiling its own graphs, verify included

SLOTS, MAX_SEQ_LEN = 4, 2048  # as chat_model, the reference
START_TIMEOUT_S = 300
PROMPTS = ["abcabcabcabc", "The cat sat on the mat. The cat sat on the", "1, 2, 3, 1, 2, 3, 1, 2,", "hello hello hello"]


@pytest.fixture(scope="module")
def server(chat_llama_dir, tmp_path_factory):
    port = free_port()
    command = [sys.executable, "-m", "qrt", "serve", str(chat_llama_dir), "--port", str(port),
               "--max-batch", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--speculative", "ngram",
               "--num-speculative-tokens", "3", "--prompt-lookup-min", "1", "--served-model-name", "x"]
    srv = ServerProcess(command, port, "/health", tmp_path_factory.mktemp("server") / "server.log")
    try:
        srv.wait_ready(START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


def _plain(model, prompt: str, max_tokens: int) -> str:
    engine = Engine(model, speculate=False)
    seq = engine.submit(model.request(model.encode(prompt), max_tokens, SamplingParams(), stop_at_eos=False, text=True))
    engine.run([seq])
    return seq.text


def test_completions_are_what_plain_decoding_gives_and_guesses_are_counted(server, chat_model):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    expected = [_plain(chat_model, prompt, 40) for prompt in PROMPTS]

    def complete(prompt: str) -> str:
        out = client.completions.create(model="x", prompt=prompt, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].text

    assert [complete(p) for p in PROMPTS] == expected
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(complete, PROMPTS)) == expected
    stream = client.completions.create(model="x", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]

    values = metrics(server.url)
    assert values["qrt_speculative_checks_total"] > 0
    assert 0 < values["qrt_speculative_accepted_tokens_total"] <= values["qrt_speculative_proposed_tokens_total"]
