"""Structured output in the engine: sampled text held to a JSON schema, a regular expression, a
list of choices or a Lark grammar, checked by a validator that is not the grammar engine."""

import json
import re

import jsonschema
import pytest

from qrt.runtime import structured
from qrt.runtime.engine import STOP, Engine
from qrt.runtime.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["answer", "count", "tags"],
    "additionalProperties": False,
}
PROMPT = [5, 17, 99, 3, 250, 41]
SEEDS = range(6)


def sample_all(model, grammar, max_tokens=64, seeds=SEEDS):
    """Each seed's request at temperature 1, run side by side in one engine."""
    engine = Engine(model, chunk_size=16)
    sequences = [engine.submit(model.request(PROMPT, max_tokens, SamplingParams(1.0, seed=seed), text=True,
                                             grammar=grammar)) for seed in seeds]
    engine.run(sequences)
    for seq in sequences:
        assert seq.error is None, seq.error
    return sequences


def test_every_sampled_answer_is_valid_under_its_json_schema(chat_model):
    for seq in sample_all(chat_model, structured.json_schema(SCHEMA)):
        assert seq.finish_reason == STOP, (seq.finish_reason, seq.text)  # the grammar ended it
        jsonschema.validate(json.loads(seq.text), SCHEMA)


def test_without_the_grammar_the_same_requests_are_not_json(chat_model):
    # The check above could not pass by chance: this random model writes no JSON of its own.
    for seq in sample_all(chat_model, None, max_tokens=24):
        with pytest.raises(ValueError):
            json.loads(seq.text)


@pytest.mark.parametrize("grammar, check", [
    (structured.regex(r"[a-c]{2,4}-[0-9]{3}"), lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text)),
    (structured.choice(["red", "green", "blue (dark)"]), lambda text: text in ("red", "green", "blue (dark)")),
    (structured.lark('start: "x" NUM ("," NUM)*\nNUM: /[0-9]{1,2}/'), lambda text: re.fullmatch(r"x\d{1,2}(,\d{1,2})*", text)),
    (structured.json_object(), lambda text: isinstance(json.loads(text), dict)),
])
def test_regex_choice_grammar_and_any_object(chat_model, grammar, check):
    for seq in sample_all(chat_model, grammar, max_tokens=48):
        if seq.finish_reason == STOP:
            assert check(seq.text), seq.text
        else:  # cut by max_tokens: what there is must still be a prefix the grammar allows
            assert seq.finish_reason == "length" and len(seq.tokens) == 48


def test_an_invalid_grammar_is_refused_when_the_request_is_made(chat_model):
    with pytest.raises(ValueError, match="structured-output grammar is invalid"):
        chat_model.request(PROMPT, 8, SamplingParams(), grammar=structured.lark('start: "a" ('))
