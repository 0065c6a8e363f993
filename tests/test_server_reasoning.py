"""A reasoning model's answer through `qrt serve`, as the openai client reads it: the tiny chat
model given a Qwen3-style chat template (its </think> marks the family), its answer forced by a
regular expression into a reasoning block and an answer. The reasoning comes back apart, as
`reasoning_content`, whole and streamed; with `--reasoning-parser none` it stays in the content."""

import json
import shutil
import sys

import openai
import pytest

from bench.serve_load import ServerProcess, free_port
from test_server import START_TIMEOUT_S

pytestmark = pytest.mark.slow  # a server process of its own

NAME = "tiny-thinker"
# ChatML, with what Qwen3's template does with an earlier answer's reasoning: keeps what follows
# </think>. That marker is what `--reasoning-parser auto` knows the family by.
THINK_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{% set content = message['content'] %}{% if '</think>' in content %}"
                  "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
                  "{{ content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FORCED = r"<think>\nTwo and two make four\.\n</think>\n\nIt is 4\."
REASONING, ANSWER = "Two and two make four.", "It is 4."
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinker_dir(chat_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-thinker")
    shutil.copytree(chat_llama_dir, folder, dirs_exist_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    return folder


def _client(folder, log_path, *flags):
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "qrt", "serve", str(folder), "--port", str(port),
                            "--max-batch", "4", "--max-seq-len", "2048", "--served-model-name", NAME, *flags],
                           port, "/health", log_path)
    server.wait_ready(START_TIMEOUT_S)
    return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def thinker(thinker_dir, tmp_path_factory):
    server, client = _client(thinker_dir, tmp_path_factory.mktemp("thinker") / "server.log")
    try:
        yield client
    finally:
        server.stop()


def _ask(client, **fields):
    return client.chat.completions.create(model=NAME, messages=ASK, max_tokens=64,
                                          extra_body={"guided_regex": FORCED}, **fields)


def test_the_reasoning_comes_apart_from_the_answer(thinker):
    reply = _ask(thinker)
    message = reply.choices[0].message
    assert message.content == ANSWER and message.reasoning_content == REASONING
    assert reply.choices[0].finish_reason == "stop"


def test_a_stream_sends_the_reasoning_first_then_the_answer(thinker):
    fields = []
    for chunk in _ask(thinker, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            sent = {key: value for key, value in delta.items() if key in ("content", "reasoning_content") and value}
            assert len(sent) <= 1  # a delta carries one of them
            fields += sent.items()
    assert "".join(text for key, text in fields if key == "reasoning_content") == REASONING
    assert "".join(text for key, text in fields if key == "content") == ANSWER
    kinds = [key for key, _ in fields]
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index)
    assert len(kinds) > 2  # streamed in pieces, not sent whole at the end


def test_with_the_parser_off_the_reasoning_stays_in_the_content(thinker_dir, tmp_path):
    server, client = _client(thinker_dir, tmp_path / "server.log", "--reasoning-parser", "none")
    try:
        message = _ask(client).choices[0].message
    finally:
        server.stop()
    assert message.content == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    assert getattr(message, "reasoning_content", None) is None
