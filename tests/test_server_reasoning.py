"""A reasoning model's answer through `qrt serve`, as the openai client reads it.

- The tiny chat model given a Qwen3-style chat template (its </think> marks the family), its answer
  forced by a regular expression into a reasoning block and an answer. The reasoning comes back
  apart, as `reasoning_content`, whole and streamed; with `--reasoning-parser none` it stays in the
  content.
- The same model with gpt-oss's harmony markers as special tokens of its tokenizer and a template
  that writes them, its answer forced by a grammar that names the special tokens (llguidance's
  `<|name|>`), so that the engine generates the markers as gpt-oss does, as ids: an analysis
  message and a final one, or a call of an offered tool."""

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


HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# gpt-oss's framing of a conversation, cut down: an earlier answer goes back as its final channel.
HARMONY_TEMPLATE = ("{% for message in messages %}<|start|>{{ message['role'] }}"
                    "{% if message['role'] == 'assistant' %}<|channel|>final{% endif %}<|message|>"
                    "{{ message['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ANSWERED = ('start: <|channel|> "analysis" <|message|> "Two and two make four." <|end|> <|start|> "assistant" '
            '<|channel|> "final" <|message|> "It is 4."')
CALLED = ('start: <|channel|> "analysis" <|message|> "The tool knows." <|end|> '
          '<|start|> "assistant to=functions.weather" <|channel|> "commentary " <|constrain|> "json" '
          '<|message|> "{\\"city\\": \\"Paris\\"}" <|call|>')
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def harmony_client(chat_llama_dir, tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-harmony")
    shutil.copytree(chat_llama_dir, folder, dirs_exist_ok=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.eos_token = "<|return|>"
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    ends = [tokenizer.convert_tokens_to_ids(marker) for marker in ("<|return|>", "<|call|>")]
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": ends}))
    server, client = _client(folder, tmp_path_factory.mktemp("harmony") / "server.log")
    try:
        yield client
    finally:
        server.stop()


def test_gpt_oss_channels_come_apart_by_their_special_tokens(harmony_client):
    reply = harmony_client.chat.completions.create(model=NAME, messages=ASK, max_tokens=96,
                                                   extra_body={"guided_grammar": ANSWERED})
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    fields = []
    for chunk in harmony_client.chat.completions.create(model=NAME, messages=ASK, max_tokens=96, stream=True,
                                                        extra_body={"guided_grammar": ANSWERED}):
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            fields += [(key, value) for key, value in delta.items() if key in ("content", "reasoning_content") and value]
    assert "".join(text for key, text in fields if key == "reasoning_content") == REASONING
    assert "".join(text for key, text in fields if key == "content") == ANSWER  # no channel names, no "assistant"


def test_a_gpt_oss_call_of_an_offered_tool_is_a_tool_call(harmony_client):
    reply = harmony_client.chat.completions.create(model=NAME, messages=ASK, max_tokens=96, tools=[WEATHER],
                                                   extra_body={"guided_grammar": CALLED})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "The tool knows."
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None


def test_with_the_parser_off_the_reasoning_stays_in_the_content(thinker_dir, tmp_path):
    server, client = _client(thinker_dir, tmp_path / "server.log", "--reasoning-parser", "none")
    try:
        message = _ask(client).choices[0].message
    finally:
        server.stop()
    assert message.content == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    assert getattr(message, "reasoning_content", None) is None
