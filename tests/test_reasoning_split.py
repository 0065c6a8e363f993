"""A chat answer's reasoning told apart from its content (qrt/runtime/reasoning.py), whole and as
it streams: <think> answers against transformers' own response parser (the template it falls back
on for Qwen's family), and gpt-oss's harmony messages, whose markers are special tokens, by the
ids the engine generates."""

import random
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

from qrt.runtime.engine import LENGTH, STOP
from qrt.runtime.reasoning import CONTENT, REASONING, parser_for, split_for
from qrt.runtime.text_stream import TextStream
from qrt.server.logprob_shapes import LogprobShapes
from qrt.server.protocol import ToolSpec
from qrt.server.replies import Prompt, Reply, Scoring
from tiny_tokenizer import write_tokenizer

QWEN_RESPONSE = next(schema for families, schema in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in families)
HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
ASK = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
THINK_ANSWERS = [
    "<think>\nTwo and two.\n</think>\n\nThe answer is 4.",
    "Just 4, no thinking.",
    "<think>\n\n</think>\n\nFour",  # Qwen3's thinking switched off: an empty block
    "<think>\nhmm  \n\nstill <thinking> </think>\n\n  Four  \n",
    "  <think>Spaces first.</think>Four</think>",  # a second close tag is content
    "<think>\nCut off while thinking, with a partial </thi",
    "<thi",  # cut off inside the opening tag
    "Tell me: is <think> a tag?",
]
WEATHER = ToolSpec.model_validate({"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level tokenizer with Qwen's <think> tags as added (not special) tokens and
    gpt-oss's harmony markers as special ones."""
    folder = tmp_path_factory.mktemp("reasoning-tokenizer")
    (folder / "config.json").write_text("{}")
    write_tokenizer(folder)
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    return tok


def _pieces_joined(pieces) -> tuple[str | None, str]:
    reasoning = "".join(text for field, text in pieces if field == REASONING)
    return reasoning or None, "".join(text for field, text in pieces if field == CONTENT)


def _streamed(split, tokenizer, ids: list[int]) -> list[tuple[str, str]]:
    """The split fed as the engine feeds it: each id, then the text its TextStream released."""
    stream, pieces = TextStream(tokenizer), []
    for token_id in ids:
        split.token(token_id)
        pieces += split.text(stream.add(token_id))
    return pieces + split.text(stream.flush()) + split.end()


@pytest.mark.parametrize("answer", THINK_ANSWERS)
@pytest.mark.parametrize("opened", [False, True], ids=["prompt-closed", "prompt-opens-think"])
def test_think_answers_split_as_transformers_parses_them(tokenizer, answer, opened):
    prompt = ASK + ("<think>\n" if opened else "")
    prompt_ids, ids = tokenizer.encode(prompt), tokenizer.encode(answer)
    parsed = tokenizer.parse_response(ids, QWEN_RESPONSE, prefix=prompt_ids)
    expected = (parsed.get("reasoning_content"), parsed.get("content", ""))
    if answer.startswith("Tell me") and not opened:
        # transformers' parser takes a <think> anywhere in the answer for the opening of
        # reasoning; here a reasoning block opens an answer or never (Qwen3's and DeepSeek-R1's
        # templates read an earlier answer so), and text that mentions the tag stays content.
        expected = (None, answer)
    whole = split_for("think", tokenizer, prompt_ids).whole(ids, tokenizer.decode(ids))
    assert whole == expected
    assert _pieces_joined(_streamed(split_for("think", tokenizer, prompt_ids), tokenizer, ids)) == expected
    # Cut anywhere, the text gives the same parts: a tag split across pieces is still a tag.
    rng = random.Random(answer)
    cut_split = split_for("think", tokenizer, prompt_ids)
    text, pieces, at = tokenizer.decode(ids), [], 0
    while at < len(text):
        step = rng.randint(1, 4)
        pieces += cut_split.text(text[at:at + step])
        at += step
    assert _pieces_joined(pieces + cut_split.end()) == expected


def test_a_streamed_think_answer_sends_nothing_it_takes_back(tokenizer):
    """Pieces come in order, reasoning first: no piece of a tag, nor of the whitespace around a
    part, is ever sent."""
    ids = tokenizer.encode("<think>\nFirst line.\n\nSecond line.\n</think>\n\nThe answer.\n")
    pieces = _streamed(split_for("think", tokenizer, tokenizer.encode(ASK)), tokenizer, ids)
    assert [field for field, _ in pieces] == sorted((field for field, _ in pieces), key=[REASONING, CONTENT].index)
    assert all("<" not in text and ">" not in text for _, text in pieces)
    assert _pieces_joined(pieces) == ("First line.\n\nSecond line.", "The answer.")


def _harmony(tokenizer, answer: str) -> list[int]:
    ids = tokenizer.encode(answer)
    assert sum(token_id in tokenizer.all_special_ids for token_id in ids) == answer.count("<|")  # markers are one id each
    return ids


HARMONY_ANSWERS = {
    "reasoning then answer": ("<|channel|>analysis<|message|>Simple sum: 2 + 2.<|end|>"
                              "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
                              ("Simple sum: 2 + 2.", "It is 4."), []),
    "a preamble to the user, then a call": (
        "<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Looking it up.<|end|><|start|>assistant to=functions.weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>', ("Ask the tool.", "Looking it up."), [("weather", '{"city": "Paris"}')]),
    "the recipient in the channel": ('<|channel|>commentary to=functions.weather json<|message|>{"city":"Oslo"}<|call|>',
                                     (None, ""), [("weather", '{"city":"Oslo"}')]),
    "a built-in tool's call is not shown": ("<|channel|>analysis to=browser.search code<|message|>{}<|call|>",
                                            (None, ""), []),
    "cut off while reasoning": ("<|channel|>analysis<|message|>Still thinking é", ("Still thinking é", ""), []),
    "plain text, no markers": ('{"forced": "by a grammar"}', (None, '{"forced": "by a grammar"}'), []),
}


@pytest.mark.parametrize("name", HARMONY_ANSWERS)
def test_harmony_channels_by_their_special_tokens(tokenizer, name):
    answer, expected, calls = HARMONY_ANSWERS[name]
    ids = _harmony(tokenizer, answer)
    # The engine's text has no markers: the channel names run into the message bodies.
    flat = tokenizer.decode(ids, skip_special_tokens=True)
    whole = split_for("harmony", tokenizer, [])
    assert whole.whole(ids, flat) == expected and whole.calls == calls
    streamed = split_for("harmony", tokenizer, [])
    assert _pieces_joined(_streamed(streamed, tokenizer, ids)) == expected and streamed.calls == calls


def test_harmony_text_held_back_by_the_engine_still_reaches_its_own_channel(tokenizer):
    """A stop string's start is held back by the engine until it is known not to be one: the
    text then comes after the next marker's id, and still belongs to the message before it."""
    ids = _harmony(tokenizer, "<|channel|>analysis<|message|>Wait for it<|end|>"
                              "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    split, stream, pieces = split_for("harmony", tokenizer, []), TextStream(tokenizer, ("it!",)), []
    for token_id in ids:
        split.token(token_id)
        pieces += split.text(stream.add(token_id))
    assert _pieces_joined(pieces + split.text(stream.flush())) == ("Wait for it", "Done.")


def test_a_tokenizer_without_the_markers_leaves_everything_content(tokenizer, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_tokenizer(tmp_path)
    plain = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    ids = plain.encode("<|channel|>analysis<|message|>x")
    assert split_for("harmony", plain, []).whole(ids, plain.decode(ids)) == (None, "<|channel|>analysis<|message|>x")
    assert split_for(None, tokenizer, []).whole([], "<think>a</think>b") == (None, "<think>a</think>b")


def test_the_parser_follows_the_templates_markers():
    assert parser_for("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"
    assert parser_for("{%- if '</think>' in content %}{% endif %}") == "think"
    assert parser_for("{{ '<|im_start|>assistant\n' }}") is None and parser_for(None) is None


def _reply(tokenizer, mode=None) -> Reply:
    scoring = Scoring(None, None, False, False)
    return Reply(True, "m", 3, LogprobShapes(tokenizer), scoring, [Prompt([1, 2, 3], None)],
                 [WEATHER] if mode else None, mode, "hermes", "harmony")


def test_a_chat_reply_sends_reasoning_apart_whole_and_streamed(tokenizer):
    answer = HARMONY_ANSWERS["reasoning then answer"][0]
    ids = _harmony(tokenizer, answer)
    seq = SimpleNamespace(tokens=ids, text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=STOP)
    assert _reply(tokenizer).message(0, seq) == ({"content": "It is 4.", "reasoning_content": "Simple sum: 2 + 2."},
                                                 STOP)
    reply, stream, deltas = _reply(tokenizer), TextStream(tokenizer), []
    for token_id in ids:
        deltas += reply.deltas(0, token_id, stream.add(token_id), False)
    deltas += reply.deltas(0, None, "", True)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Simple sum: 2 + 2."
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."
    assert all(len(d) == 1 for d in deltas)  # each delta one field


def test_a_harmony_call_of_an_offered_tool_becomes_a_tool_call(tokenizer):
    answer = HARMONY_ANSWERS["a preamble to the user, then a call"][0]
    ids = _harmony(tokenizer, answer)
    seq = SimpleNamespace(tokens=ids, text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=STOP)
    message, finish = _reply(tokenizer, "auto").message(0, seq)
    assert finish == "tool_calls" and message["reasoning_content"] == "Ask the tool."
    assert message["content"] == "Looking it up."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    # A call with nothing said beside it has no content, as OpenAI sends it.
    answer = HARMONY_ANSWERS["the recipient in the channel"][0]
    ids = _harmony(tokenizer, answer)
    alone = SimpleNamespace(tokens=ids, text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=STOP)
    message, finish = _reply(tokenizer, "auto").message(0, alone)
    assert finish == "tool_calls" and message["content"] is None and "reasoning_content" not in message
    # Cut short, the answer stays as it is, its call not read.
    message, finish = _reply(tokenizer, "auto").message(0, SimpleNamespace(**{**vars(seq), "finish_reason": LENGTH}))
    assert finish == LENGTH and "tool_calls" not in message
