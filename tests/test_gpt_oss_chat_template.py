"""gpt-oss's chat template (its "harmony" format) as the model ships it, rendered by qrt as
transformers' apply_chat_template renders it. The template is the copy llama.cpp keeps of the one in
OpenAI's tokenizer files (models/templates/openai-gpt-oss-120b.jinja, from llama-cpp-python's
source distribution, fetched once by bench/tools/scale_models.py): nothing is downloaded from a
model hub here.

Each conversation exercises a part of the template: the system prompt it writes itself (with
today's date and the reasoning effort), a system or developer message as its developer
instructions, reasoning dropped from earlier answers but kept before a tool call, tools as its
TypeScript-like `functions` namespace, a tool call and its result, and the template's own refusal
of channel tags inside a message. The reasoning comes as `reasoning_content` (how qrt's server and
OpenAI clients send it) to qrt and as `thinking` (the field gpt-oss's template reads) to
transformers: qrt hands the template both names."""

import json

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from qrt.runtime.chat_template import ChatTemplateError, render_chat

pytestmark = pytest.mark.slow  # fetches llama-cpp-python's source distribution on first use

MAX_CHARS = 1 << 16
TEMPLATE_PATH = "models/templates/openai-gpt-oss-120b.jinja"
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
CALL = {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    "one question": ([{"role": "user", "content": "What is 2 + 2?"}], None),
    "system prompt and an earlier answer with reasoning": ([
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Quatre.", "reasoning_content": "A simple sum."},
        {"role": "user", "content": "And 3 + 3?"}], None),
    "developer instructions": ([
        {"role": "developer", "content": "Never use numbers."},
        {"role": "user", "content": "How many legs has a cat?"}], None),
    "tools, a call with its reasoning, and its result": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "The weather tool knows.", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temperature": 21}'}], [WEATHER]),
    "tools offered, not yet called": ([{"role": "user", "content": "Weather in Oslo, in f?"}], [WEATHER]),
}


@pytest.fixture(scope="module")
def tokenizer():
    from bench.tools.scale_models import llama_cpp_source

    template = (llama_cpp_source() / TEMPLATE_PATH).read_text()
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  bos_token="<|startoftext|>", eos_token="<|return|>", unk_token="<unk>")
    tok.chat_template = template
    return tok


def _as_transformers_takes_it(messages: list[dict]) -> list[dict]:
    """The same messages with their reasoning under `thinking`, the name gpt-oss's template reads."""
    renamed = []
    for message in messages:
        message = dict(message)
        if "reasoning_content" in message:
            message["thinking"] = message.pop("reasoning_content")
        renamed.append(message)
    return renamed


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_renders_as_transformers_renders_it(tokenizer, name):
    messages, tools = CONVERSATIONS[name]
    got = render_chat(tokenizer, messages, tools, MAX_CHARS, "gpt-oss")
    expected = tokenizer.apply_chat_template(_as_transformers_takes_it(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    assert got == expected
    # The harmony framing itself, so that a template that rendered nothing would not pass.
    assert got.startswith("<|start|>system<|message|>") and got.endswith("<|start|>assistant")
    last = messages[-1]
    shown = json.dumps(last["content"]) if last["role"] == "tool" else last["content"]  # a result goes in as JSON
    assert "Reasoning: medium" in got and shown in got


def test_reasoning_is_kept_before_a_tool_call_and_dropped_from_a_final_answer(tokenizer):
    with_call = render_chat(tokenizer, *CONVERSATIONS["tools, a call with its reasoning, and its result"],
                            MAX_CHARS, "gpt-oss")
    assert "<|channel|>analysis<|message|>The weather tool knows.<|end|>" in with_call
    assert 'functions.weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in with_call
    assert "namespace functions" in with_call and "city: string" in with_call
    answered = render_chat(tokenizer, *CONVERSATIONS["system prompt and an earlier answer with reasoning"],
                           MAX_CHARS, "gpt-oss")
    assert "A simple sum." not in answered and "<|channel|>final<|message|>Quatre.<|end|>" in answered


@pytest.mark.parametrize("effort", ["low", "high"])
def test_the_reasoning_effort_of_a_request_reaches_the_system_prompt(tokenizer, effort):
    messages, _ = CONVERSATIONS["one question"]
    got = render_chat(tokenizer, messages, None, MAX_CHARS, "gpt-oss", {"reasoning_effort": effort})
    assert got == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                reasoning_effort=effort)
    assert f"Reasoning: {effort}\n" in got


def test_channel_tags_inside_a_message_are_refused_with_the_templates_words(tokenizer):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<|channel|>final<|message|>Hello"},
                {"role": "user", "content": "Again"}]
    with pytest.raises(ChatTemplateError, match="containing <|channel|> tags in the content field"):
        render_chat(tokenizer, messages, None, MAX_CHARS, "gpt-oss")


@pytest.mark.parametrize("turn", [
    {"role": "assistant", "reasoning_content": "A simple sum.", "content": "Quatre."},
    {"role": "assistant", "reasoning_content": "The weather tool knows.", "tool_calls": [CALL]},
], ids=["reasoning and an answer", "reasoning and a call"])
def test_an_answer_the_template_writes_splits_back_into_its_parts(tokenizer, tmp_path, turn):
    """An assistant turn as the template writes it (rendered by transformers) after the generation
    prompt (rendered by qrt) is what gpt-oss generates: tokenized with the harmony markers as special tokens, qrt's reasoning split gives
    back the turn's reasoning, answer and call."""
    from tiny_tokenizer import write_tokenizer

    from qrt.runtime.reasoning import parser_for, split_for

    (tmp_path / "config.json").write_text("{}")
    write_tokenizer(tmp_path)
    harmony = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    harmony.add_special_tokens({"additional_special_tokens": [
        "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]})
    harmony.chat_template = tokenizer.chat_template
    asked = [{"role": "user", "content": "2 + 2, or the weather in Paris?"}]
    prompt = render_chat(harmony, asked, [WEATHER], MAX_CHARS, "gpt-oss")
    written = harmony.apply_chat_template(_as_transformers_takes_it(asked + [turn]), tools=[WEATHER], tokenize=False)
    assert written.startswith(prompt)
    ids = harmony.encode(written[len(prompt):], add_special_tokens=False)
    assert parser_for(harmony.chat_template) == "harmony"
    split = split_for("harmony", harmony, harmony.encode(prompt))
    reasoning, content = split.whole(ids, harmony.decode(ids, skip_special_tokens=True))
    assert reasoning == turn["reasoning_content"] and content == turn.get("content", "")
    expected_calls = [("weather", json.dumps(CALL["function"]["arguments"]))] if "tool_calls" in turn else []
    assert split.calls == expected_calls
