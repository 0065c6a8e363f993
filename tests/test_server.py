"""`qrt serve` as users run it: a real server process on a free localhost port, driven by the
openai client (and raw HTTP where the client would refuse to send something). Every output is
checked against the same model's `generate` in this process."""

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # the HTTP client the openai package is built on
import jsonschema
import openai
import pytest

from bench.serve_load import ServerProcess, free_port, metrics
from qrt.runtime.sampling import SamplingParams

KEY = "test-key"
NAME = "tiny-chat"
SLOTS, MAX_SEQ_LEN, MAX_QUEUE = 4, 2048, 8  # as chat_model
START_TIMEOUT_S = 300  # a cold compile of the tiny model under a loaded CI machine


class Server(ServerProcess):
    """`qrt serve` on the tiny chat model, with the helpers the tests read it by."""

    def __init__(self, folder, log_path):
        port = free_port()
        command = [sys.executable, "-m", "qrt", "serve", str(folder), "--port", str(port),
                   "--max-batch", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--max-queue", str(MAX_QUEUE),
                   "--api-key", KEY, "--served-model-name", NAME]
        super().__init__(command, port, "/health", log_path)

    def metrics(self) -> dict[str, float]:
        return metrics(self.url)

    def wait_metrics(self, check, timeout: float = 15) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if check(values) or time.monotonic() > deadline:
                return values
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(chat_llama_dir, tmp_path_factory):
    srv = Server(chat_llama_dir, tmp_path_factory.mktemp("server") / "server.log")
    try:
        srv.wait_ready(START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def expected(model, prompt_ids, max_tokens, stop=()) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of the request alone, greedy, in this process."""
    engine = model.engine
    seq = engine.submit(model.request(prompt_ids, max_tokens, SamplingParams(), stop_strings=tuple(stop), text=True))
    engine.run([seq])
    return seq.text, len(seq.tokens), seq.finish_reason


def _outcome(values, outcome):
    return values.get(f'qrt_requests_total{{outcome="{outcome}"}}', 0.0)


def test_health_is_503_until_compiled_then_models_and_metrics_answer(server, client):
    assert 503 in server.ready_codes and server.ready_codes[-1] == 200
    assert [m.id for m in client.models.list().data] == [NAME]
    values = server.metrics()
    assert values["qrt_slots"] == SLOTS and values["qrt_active_slots"] == 0 and values["qrt_queue_depth"] == 0


def test_completion_and_chat_give_what_generate_gives(client, chat_model):
    prompt = "The capital of France is"
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    text, tokens, reason = expected(chat_model, chat_model.encode(prompt), 12)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (text, reason)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(chat_model.encode(prompt)), tokens)
    assert out.choices[0].text == chat_model.generate(prompt, 12)

    ids = [72, 101, 108, 108, 111]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=7, temperature=0)
    assert out.choices[0].text == expected(chat_model, ids, 7)[0]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10, temperature=0)
    text, tokens, reason = expected(chat_model, chat_model.encode_messages(messages), 10)
    assert (chat.choices[0].message.role, chat.choices[0].message.content) == ("assistant", text)
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (tokens, reason)


def test_streams_send_the_same_text_in_pieces_then_usage_and_done(server, client, chat_model):
    prompt = "Once upon a time"
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=14, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=14, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks for it
    # The wire format itself: server-sent events ending in [DONE].
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": NAME, "prompt": "x", "max_tokens": 3, "stream": True}, timeout=60) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_stop_strings_across_token_boundaries_and_stop_token_ids(client, chat_model):
    prompt = "abc"
    free = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0).choices[0].text
    start = next(i for i in range(1, len(free) - 2) if "\ufffd" not in free[i:i + 3])
    stop = free[start:start + 3]  # three characters: three byte-level tokens or more
    for stream in (False, True):
        reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
                                          stream=stream)
        if stream:
            chunks = list(reply)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = reply.choices[0].text, reply.choices[0].finish_reason
        assert (text, reason) == (free[:free.index(stop)], "stop")
    ids = chat_model.generate(chat_model.encode(prompt), 20, stop_at_eos=False)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0,
                                    extra_body={"stop_token_ids": [ids[5]]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == ids.index(ids[5]) + 1


def scored_alone(model, prompt_ids, max_tokens, top):
    """The in-process engine's Sequence for a greedy request scoring its prompt and new tokens."""
    engine = model.engine
    seq = engine.submit(model.request(prompt_ids, max_tokens, SamplingParams(), text=True, stop_at_eos=False,
                                      logprobs=top, prompt_logprobs=top))
    engine.run([seq])
    return seq


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, chat_model):
    # lm-evaluation-harness's loglikelihood request: token ids, one new token, echo, logprobs 1.
    ids = chat_model.encode("The quick brown fox jumps over the lazy dog")
    out = client.completions.create(model=NAME, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=1,
                                    seed=1234)
    choice = out.choices[0]
    seq = scored_alone(chat_model, ids, 1, 1)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    scores = seq.prompt_logprobs[1:] + seq.logprobs
    assert logprobs.tokens == [chat_model.tokenizer.decode([t]) for t in ids + seq.tokens]
    assert max(abs(a - b.logprob) for a, b in zip(logprobs.token_logprobs[1:], scores)) < 1e-5
    for top, score in zip(logprobs.top_logprobs[1:], scores):
        ((piece, value),) = top.items()
        assert piece == chat_model.tokenizer.decode([score.top[0][0]]) and abs(value - score.top[0][1]) < 1e-5
    assert choice.text == chat_model.tokenizer.decode(ids) + seq.text
    # Each offset is where its token's text starts in the choice's text.
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and all(choice.text[o:].startswith(t) for o, t in zip(offsets, logprobs.tokens))


def test_a_streamed_echo_sends_the_prompt_first_then_what_a_whole_reply_holds(client):
    whole = client.completions.create(model=NAME, prompt="Echo me", max_tokens=6, temperature=0, echo=True)
    for logprobs in (None, 1):
        chunks = [c for c in client.completions.create(model=NAME, prompt="Echo me", max_tokens=6, temperature=0,
                                                       echo=True, logprobs=logprobs, stream=True)]
        assert chunks[0].choices[0].text == "Echo me"
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        if logprobs:  # the prompt's scores come with it: the first token's are None
            assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_echo_with_no_new_tokens_returns_the_prompt_and_its_scores(client, chat_model):
    prompt = "Scored, not continued."
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    seq = scored_alone(chat_model, chat_model.encode(prompt), 0, 0)
    assert [x.logprob for x in seq.prompt_logprobs[1:]] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
    assert all(top == {} for top in choice.logprobs.top_logprobs[1:])


def test_several_prompts_are_choices_each_as_alone(client, chat_model):
    prompts = ["One prompt", "and another, longer prompt", "a third"]
    out = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [expected(chat_model, chat_model.encode(p), 6) for p in prompts]
    assert [c.text for c in out.choices] == [text for text, _, _ in alone]
    assert out.usage.completion_tokens == sum(tokens for _, tokens, _ in alone)
    assert out.usage.prompt_tokens == sum(len(chat_model.encode(p)) for p in prompts)
    stream = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [text for text, _, _ in alone]


def test_chat_logprobs_list_each_token_with_its_alternatives(client, chat_model):
    messages = [{"role": "user", "content": "Name a colour."}]
    for stream in (False, True):
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                               logprobs=True, top_logprobs=3, stream=stream)
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            text, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
        seq = scored_alone(chat_model, chat_model.encode_messages(messages), 5, 3)
        assert [e.token for e in content] == [chat_model.tokenizer.decode([t]) for t in seq.tokens]
        assert "".join(e.token for e in content).startswith(text)
        assert [e.logprob for e in content] == pytest.approx([s.logprob for s in seq.logprobs], abs=1e-5)
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[2].logprob
                   for e in content)
        assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in content)


def test_n_choices_are_seeded_sequences_each_as_alone(client, chat_model):
    prompt = "Once upon a time"
    ids = chat_model.encode(prompt)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2] and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1
    for j, text in enumerate(texts):  # choice j is the request alone with seed 7 + j
        engine = chat_model.engine
        seq = engine.submit(chat_model.request(ids, 8, SamplingParams(1.0, seed=7 + j), text=True))
        engine.run([seq])
        assert text == seq.text, j
    assert out.usage.prompt_tokens == len(ids)  # once, whatever n is
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=1.0, seed=3, n=2, stream=True)
    indexes = {choice.index for chunk in chat for choice in chunk.choices}
    assert indexes == {0, 1}


def test_penalties_and_logit_bias_give_what_the_engine_gives_with_them(client, chat_model):
    prompt = "la la la la la"
    fields = dict(presence_penalty=0.8, frequency_penalty=0.5, logit_bias={"97": 2.5})
    vllm_fields = dict(repetition_penalty=1.4, min_tokens=3)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, **fields,
                                    extra_body=vllm_fields)
    params = SamplingParams(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4,
                            logit_bias=((97, 2.5),), min_tokens=3)
    engine = chat_model.engine
    seq = engine.submit(chat_model.request(chat_model.encode(prompt), 10, params, text=True))
    engine.run([seq])
    assert out.choices[0].text == seq.text
    assert out.choices[0].text != expected(chat_model, chat_model.encode(prompt), 10)[0]


def test_structured_output_answers_validate_against_their_schema(client):

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 50}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Reply in JSON."}]
    for stream in (False, True):
        for seed in range(3):
            reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=1.0,
                                                   seed=seed, response_format=fmt, stream=stream)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            else:
                text = reply.choices[0].message.content
            jsonschema.validate(json.loads(text), schema)
    out = client.completions.create(model=NAME, prompt="Colour:", max_tokens=10, temperature=1.0, seed=1,
                                    extra_body={"guided_choice": ["red", "green"]})
    assert out.choices[0].text in ("red", "green") and out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="structured-output grammar is invalid"):
        client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body={"guided_grammar": 'start: "a" ('})
    with pytest.raises(openai.BadRequestError, match="one structured-output constraint per request"):
        client.completions.create(model=NAME, prompt="x", max_tokens=4,
                                  extra_body={"response_format": {"type": "json_object"}, "guided_regex": "a+"})


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def _streamed_calls(chunks) -> tuple[list[dict], str]:
    """The tool calls a stream sent (name and arguments, by index) and its finish reason."""
    calls, finish = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_a_forced_tool_call_has_arguments_valid_for_its_schema(client):
    """tool_choice naming a function, or "required": the answer is a call whose arguments follow
    the function's parameters schema (the untrained model is held to it by the grammar)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, seed in ((named, 1), ("required", 2), ("required", 3)):
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
                                               max_tokens=100, temperature=1.0, seed=seed)
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        assert call.type == "function" and call.id.startswith("call_")
        assert choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        stream = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
                                                max_tokens=100, temperature=1.0, seed=seed, stream=True)
        calls, finish = _streamed_calls(stream)
        assert finish == "tool_calls" and calls == [{"name": call.function.name, "arguments": call.function.arguments}]


def test_tools_offered_in_auto_leave_a_plain_answer_as_text(client, chat_model):
    """With tool_choice "auto" the model decides; the tiny model's answer holds no <tool_call>
    block, so it comes back as its text (its chat template does not show tools, so the prompt,
    and the text, are the request's without tools). A conversation that carries earlier calls
    and a tool's result is taken."""
    ids = chat_model.encode_messages(ASK)
    text, _, finish = expected(chat_model, ids, 12)
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == text and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == finish
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=NAME, messages=turns, tools=[WEATHER], max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="'required' needs tools"):
        client.chat.completions.create(model=NAME, messages=ASK, tool_choice="required", max_tokens=4)


def test_reasoning_and_template_variables_are_taken_as_reasoning_clients_send_them(client, chat_model):
    """An assistant's earlier reasoning (`reasoning_content`, or vLLM's `reasoning`), OpenAI's
    `reasoning_effort` and vLLM's `chat_template_kwargs` are taken, and reach the template as
    render_chat hands them on (tests/test_chat_template_sandbox.py, test_gpt_oss_chat_template.py);
    the tiny model's template reads none of them, so its answer is the plain conversation's. A
    variable that would replace the conversation, or two efforts that disagree, are 400s."""
    turns = ASK + [{"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool said so."},
                   {"role": "user", "content": "And tomorrow?"}]
    plain = [{key: value for key, value in turn.items() if key != "reasoning_content"} for turn in turns]
    text, _, _ = expected(chat_model, chat_model.encode_messages(plain), 8)
    reply = client.chat.completions.create(model=NAME, messages=turns, max_tokens=8, temperature=0,
                                           reasoning_effort="high",
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == text
    for fields, words in ((dict(extra_body={"chat_template_kwargs": {"messages": []}}), "may not set ['messages']"),
                          (dict(reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}),
                           "disagree"),
                          (dict(reasoning_effort="extreme"), "reasoning_effort")):
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, **fields)


@pytest.mark.parametrize("fields, param, words", [
    (dict(n=17), "n", "less than or equal to 16"),
    (dict(best_of=2), "best_of", "best_of=2 is not supported"),
    (dict(logit_bias={"999": 1}), "logit_bias", "token ids must be in [0, 300)"),
    (dict(logprobs=21), "logprobs", "less than or equal to 20"),
    (dict(max_tokens=0), None, "max_tokens=0 returns nothing without echo=true"),
    (dict(prompt=["a"] * 65), "prompt", "at most 64 prompts per request"),
    (dict(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate", "unknown field 'frobnicate'"),
    (dict(max_tokens=2100), "max_tokens", "+ max_tokens (2100) = 210"),
    (dict(prompt=[5, 999]), "prompt", "token ids must be in [0, 300)"),
    (dict(stream_options={"include_usage": True}), None, "stream_options is only allowed with stream=true"),
    (dict(temperature=3), "temperature", "less than or equal to 2"),
])
def test_unsupported_or_invalid_fields_are_400s_that_name_them(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"model": NAME, "prompt": "hello", "max_tokens": 4, **fields})
    error = caught.value.body
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_other_errors_have_the_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-chat'"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages.0.role"):
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only a tool message, has a tool_call_id"):
        client.chat.completions.create(model=NAME, messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = httpx.post(f"{server.url}/v1/completions", headers=headers, content=b'{"model": ', timeout=30)
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    big = json.dumps({"model": NAME, "prompt": "a" * (2 << 20)})
    raw = httpx.post(f"{server.url}/v1/completions", headers=headers, content=big, timeout=30)
    assert raw.status_code == 413 and raw.json()["error"]["code"] == "request_too_large"


def test_a_bad_utf8_stop_string_fails_alone(server, client, chat_model):
    # A lone surrogate is valid JSON but no UTF-8 text; the openai client cannot even send it.
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 4, "stop": ["\\ud800"]}' % NAME.encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(client.completions.create, model=NAME, prompt=f"story {i}", max_tokens=24, temperature=0)
                for i in range(3)]
        bad = [httpx.post(f"{server.url}/v1/completions", headers=headers, content=body, timeout=30) for _ in range(3)]
        good = [f.result().choices[0].text for f in good]
    assert all(r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"] for r in bad)
    assert good == [expected(chat_model, chat_model.encode(f"story {i}"), 24)[0] for i in range(3)]


def test_api_key_is_required_on_v1_but_not_for_health(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    raw = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=30)
    assert raw.status_code == 401 and raw.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_eight_concurrent_clients_each_get_what_they_get_alone(client, chat_model):
    # Lengths from one token to past the 256-token prefill chunk; more clients than slots.
    prompts = ["x", "Hello", "The quick brown fox", "a" * 40, "lorem ipsum " * 8, "Q: 2+2? A:", "z" * 300, "end"]
    limits = [20, 9, 31, 14, 25, 40, 12, 17]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client.completions.create, model=NAME, prompt=p, max_tokens=n, temperature=0)
                   for p, n in zip(prompts, limits)]
        got = [(f.result().choices[0].text, f.result().usage.completion_tokens) for f in futures]
    assert got == [expected(chat_model, chat_model.encode(p), n)[:2] for p, n in zip(prompts, limits)]


def test_a_client_that_disconnects_frees_its_slot(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "go", "max_tokens": MAX_SEQ_LEN - 8, "temperature": 0, "ignore_eos": True}
    before = _outcome(server.metrics(), "cancelled")
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=headers, json={**body, "stream": True},
                      timeout=60) as reply:
        lines = reply.iter_lines()
        next(lines), next(lines)  # the stream is running; now hang up
    values = server.wait_metrics(lambda v: _outcome(v, "cancelled") >= before + 1 and v["qrt_active_slots"] == 0)
    assert _outcome(values, "cancelled") == before + 1 and values["qrt_active_slots"] == 0
    # Not streaming: with the other slots kept busy (the tiny model is fast), a client hangs up
    # while the server generates its answer; its slot frees while the others run on.
    with httpx.Client(headers=headers, timeout=60) as http:
        fillers = [http.send(http.build_request("POST", f"{server.url}/v1/completions", json={**body, "stream": True}),
                             stream=True) for _ in range(SLOTS - 1)]
        payload = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                         % (KEY.encode(), len(payload), payload))
            assert server.wait_metrics(lambda v: v["qrt_active_slots"] == SLOTS)["qrt_active_slots"] == SLOTS
        values = server.wait_metrics(lambda v: _outcome(v, "cancelled") >= before + 2)
        assert _outcome(values, "cancelled") == before + 2 and values["qrt_active_slots"] == SLOTS - 1
        for filler in fillers:
            filler.close()
    values = server.wait_metrics(lambda v: v["qrt_active_slots"] == 0)
    assert _outcome(values, "cancelled") == before + 2 + SLOTS - 1 and values["qrt_active_slots"] == 0


def test_a_full_queue_is_a_503_with_retry_after(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "wait", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(SLOTS + MAX_QUEUE + 4) as pool:
        replies = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/completions", headers=headers, json=body,
                                                     timeout=120), range(SLOTS + MAX_QUEUE + 4)))
    refused = [r for r in replies if r.status_code == 503]
    assert refused and all(r.headers.get("retry-after") == "1" and "queue is full" in r.json()["error"]["message"]
                           for r in refused)
    assert all(r.status_code == 200 for r in replies if r not in refused)
    values = server.wait_metrics(lambda v: v["qrt_active_slots"] == 0 and v["qrt_queue_depth"] == 0)
    assert values["qrt_active_slots"] == 0 and values["qrt_queue_depth"] == 0


def test_sigterm_lets_the_running_stream_finish_then_exits(server):
    """Last in this module: it stops the module's server. A 1000-token stream, which the tiny model
    takes about a second for."""
    headers = {"Authorization": f"Bearer {KEY}"}
    lines, started = [], threading.Event()

    def stream():
        body = {"model": NAME, "prompt": "drain", "max_tokens": 1000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=headers, json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    os.killpg(server.process.pid, signal.SIGTERM)
    at_signal = len(lines)
    reader.join(120)
    assert server.process.wait(60) == 0
    assert len(lines) > at_signal + 20  # the stream went on after the signal
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert "server stopped" in server.output()
