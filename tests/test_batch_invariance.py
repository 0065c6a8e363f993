"""A request's tokens do not depend on its batch company: the default model in bf16 (where a
different summation order does flip greedy choices), four prompts of different lengths arriving
at different times, against each run alone; through the engine, and through `qrt serve` with
concurrent clients. Greedy decoding, so any difference in a row's logits can show."""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from bench.serve_load import ServerProcess, free_port
from qrt import runtime
from qrt.runtime.default_model import default_model_path
from qrt.runtime.evaluate import DEFAULT_TEXT
from qrt.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.runs_first]  # the default model compiled and served

SLOTS, MAX_SEQ_LEN, NEW_TOKENS = 4, 1024, 48
PROMPT_TOKENS = (12, 300, 57, 140)  # different lengths: different attended extents in every decode step
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def model():
    return runtime.compile_model(default_model_path(progress=False), progress=False, max_batch_size=SLOTS,
                                 max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def prompts(model):
    """Text prompts of PROMPT_TOKENS tokens each, cut from different places of the eval text."""
    words = DEFAULT_TEXT.read_text().split()
    texts = []
    for i, length in enumerate(PROMPT_TOKENS):
        ids = model.encode(" ".join(words[400 * i:400 * i + 2 * length]))[:length]
        texts.append(model.tokenizer.decode(ids))
    return texts


def _alone(model, prompt: str, stop_at_eos: bool = False) -> tuple[list[int], str]:
    engine = model.engine
    seq = engine.submit(model.request(model.encode(prompt), NEW_TOKENS, SamplingParams(), stop_at_eos=stop_at_eos,
                                      text=True))
    engine.run([seq])
    return seq.tokens, seq.text


def test_engine_rows_equal_the_same_requests_alone(model, prompts):
    alone = [_alone(model, p)[0] for p in prompts]
    engine = model.engine
    requests = [model.request(model.encode(p), NEW_TOKENS, SamplingParams(), stop_at_eos=False) for p in prompts]
    # Arrivals: the first alone for 3 steps, the second joins for 5, then the other two together.
    sequences = [engine.submit(requests[0])]
    for _ in range(3):
        engine.step()
    sequences.append(engine.submit(requests[1]))
    for _ in range(5):
        engine.step()
    sequences += [engine.submit(r) for r in requests[2:]]
    engine.run(sequences)
    for i, (seq, expected) in enumerate(zip(sequences, alone)):
        assert seq.tokens == expected, f"prompt {i} ({PROMPT_TOKENS[i]} tokens) changed in company"


def test_server_completions_equal_the_same_requests_alone(model, prompts, tmp_path):
    alone = [_alone(model, p, stop_at_eos=True)[1] for p in prompts]  # as the server stops
    port = free_port()
    command = [sys.executable, "-m", "qrt", "serve", str(model.source), "--served-model-name", "default",
               "--port", str(port), "--max-batch", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN)]
    with ServerProcess(command, port, "/health", tmp_path / "server.log") as server:
        server.wait_ready(START_TIMEOUT_S)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        started = threading.Barrier(len(prompts))

        def complete(i: int) -> str:
            started.wait(timeout=60)
            time.sleep(0.15 * i)  # arriving one after another, while the earlier ones decode
            answer = client.completions.create(model="default", prompt=prompts[i], max_tokens=NEW_TOKENS,
                                               temperature=0)
            return answer.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, range(len(prompts))))
    for i, (text, expected) in enumerate(zip(texts, alone)):
        assert text == expected, f"prompt {i} ({PROMPT_TOKENS[i]} tokens) changed in company"
