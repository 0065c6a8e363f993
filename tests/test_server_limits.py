"""Limits and admission of `qrt serve`, against one server on the tiny chat model (4 slots, 8
queue places): hostile requests are refused up front with the field named, and leave the server
answering as before; a flood is admitted up to slots + queue places, and streams whose clients
hang up give their places back."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest
from starlette.requests import ClientDisconnect
from test_server import KEY, MAX_QUEUE, MAX_SEQ_LEN, NAME, SLOTS, START_TIMEOUT_S, Server, _outcome

from qrt.runtime.engine import Request, Sequence
from qrt.server import delivery

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
VOCAB = 300  # the tiny model's
ROOM = SLOTS + MAX_QUEUE
LOGPROB_BUDGET = SLOTS * MAX_SEQ_LEN * 21  # budgets.Budgets: every slot's tokens with 20 alternatives
REPLY_TIMEOUT_S = 60  # every refusal must come well within it: a hang fails the test
RSS_GROWTH_MIB = 64  # what the storm may leave behind (allocator slack; nothing of it is held by a request)


@pytest.fixture(scope="module")
def server(chat_llama_dir, tmp_path_factory):
    srv = Server(chat_llama_dir, tmp_path_factory.mktemp("server-limits") / "server.log")
    try:
        srv.wait_ready(START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


def post(server, body, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, headers=HEADERS, content=content, timeout=REPLY_TIMEOUT_S)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def nested_schema_text(depth: int) -> str:
    """A JSON schema of objects `depth` deep, as text (json.dumps itself cannot go that deep)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


def completion(**fields) -> dict:
    return {"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, **fields}


def chat(**fields) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            **fields}


def schema_body(schema_text: str) -> bytes:
    return (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}'
            % (NAME.encode(), schema_text.encode()))


# (name, path, body (dict, or raw bytes), status, param, words in the message)
HOSTILE = [
    ("a thousand prompts", "/v1/completions", completion(prompt=["a"] * 1000), 400, "prompt", "at most 64 prompts"),
    ("more prompts than the room", "/v1/completions", completion(prompt=["a"] * (ROOM + 1)), 400, "prompt",
     f"asks for {ROOM + 1} sequences"),
    ("prompts × n over the room", "/v1/completions", completion(prompt=["a", "b"], n=ROOM // 2 + 1), 400, "n",
     f"asks for {2 * (ROOM // 2 + 1)} sequences"),
    ("past the slot", "/v1/completions", completion(max_tokens=MAX_SEQ_LEN), 400, "max_tokens", "exceeds max_seq_len"),
    ("logprobs over the budget", "/v1/completions", completion(n=ROOM, logprobs=20, max_tokens=1000), 400,
     "logprobs", "log-probability entries"),
    ("chat top_logprobs over the budget", "/v1/chat/completions",
     chat(n=9, logprobs=True, top_logprobs=20, max_tokens=1000), 400, "top_logprobs", "log-probability entries"),
    ("a scored echo over the budget", "/v1/completions",
     completion(prompt=[65] * 2000, echo=True, logprobs=20, max_tokens=8, n=5), 400, "logprobs",
     f"limit is {LOGPROB_BUDGET}"),
    ("logit_bias past the vocabulary", "/v1/completions", completion(logit_bias={str(VOCAB): 1}), 400, "logit_bias",
     f"must be in [0, {VOCAB})"),
    ("logit_bias negative", "/v1/completions", completion(logit_bias={"-1": 1}), 400, "logit_bias", "must be in"),
    ("prompt id negative", "/v1/completions", completion(prompt=[5, -1]), 400, "prompt", "must be in"),
    ("prompt id past the vocabulary", "/v1/completions", completion(prompt=[[5, 1 << 40]]), 400, "prompt",
     "must be in"),
    ("stop token past the vocabulary", "/v1/completions", completion(stop_token_ids=[5000]), 400, "stop",
     "must be in"),
    ("seed past a generator's", "/v1/completions", completion(seed=1 << 64), 400, "seed", "seed must be from"),
    ("seed + n past a generator's", "/v1/completions", completion(seed=(1 << 64) - 1, n=2), 400, "seed",
     "seed must be from"),
    ("an infinite repetition penalty", "/v1/completions",
     b'{"model": "%s", "prompt": "x", "repetition_penalty": Infinity}' % NAME.encode(), 400, "repetition_penalty",
     "finite"),
    ("a body that is not UTF-8", "/v1/completions", b'{"model": "%s", "prompt": "\xff\xfe"}' % NAME.encode(), 400,
     None, "not UTF-8"),
    ("a body that is not JSON", "/v1/completions", b"model=tiny-chat&prompt=hi", 400, None, "not valid JSON"),
    ("a body nested 100,000 deep", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None,
     "nested too deeply"),
    ("a schema nested 10,000 deep", "/v1/chat/completions", schema_body(nested_schema_text(10_000)), 400, None,
     "nested too deeply"),
    ("a schema nested 150 deep", "/v1/chat/completions", schema_body(nested_schema_text(150)), 400,
     "response_format", "recursion limit"),
    ("a regex whose lexer blows up", "/v1/completions", completion(guided_regex="(a{1000}){1000}"), 400,
     "guided_regex", "structured"),
    ("a Lark grammar of a million items", "/v1/chat/completions",
     chat(guided_grammar='start: ("a"{1000}){1000}'), 400, "guided_grammar", "Too many items"),
    ("a Lark grammar that does not parse", "/v1/chat/completions", chat(guided_grammar="start: ("), 400,
     "guided_grammar", "invalid"),
    ("a bad JSON schema type", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, "response_format", "nonsense"),
]

# Hostile-looking grammars that llguidance compiles lazily, in bounded time: they are served.
SERVED = [
    ("an ambiguous regex, nested", "/v1/completions", completion(guided_regex="(" * 30 + "(a|aa)*b" + ")*" * 30)),
    ("an ambiguous regex, repeated", "/v1/completions", completion(guided_regex="((a|aa)*b)" * 200)),
    ("a blowup-prone DFA", "/v1/completions", completion(guided_regex="(a|b)*a(a|b){30}")),
]


def test_hostile_requests_are_refused_up_front_and_leave_the_server_as_it_was(server):
    baseline = completion(prompt="The same greedy request", max_tokens=24)
    before = post(server, baseline)
    assert before.status_code == 200, before.text
    # The first structured request makes each side's view of the vocabulary (a one-off cost).
    assert post(server, completion(guided_regex="[ab]{3}")).status_code == 200
    rss_before = rss_mib(server.process.pid)
    wrong = []
    for name, path, body, status, param, words in HOSTILE:
        started = time.monotonic()
        reply = post(server, body, path)
        took = time.monotonic() - started
        error = reply.json().get("error") or {} if reply.headers.get("content-type") == "application/json" else {}
        got = (reply.status_code, error.get("param"), words in (error.get("message") or ""))
        if got != (status, param, True):
            wrong.append(f"{name}: expected {status} param={param!r} with {words!r}, got {reply.status_code} "
                         f"{reply.text[:300]} after {took:.1f} s")
    for name, path, body in SERVED:
        reply = post(server, body, path)
        if reply.status_code != 200:
            wrong.append(f"{name}: expected 200, got {reply.status_code} {reply.text[:300]}")
    assert not wrong, "\n".join(wrong)
    after = post(server, baseline)
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    growth = rss_mib(server.process.pid) - rss_before
    print(f"the server's RSS: {rss_before:.0f} MiB before the hostile requests, grew by {growth:.1f} MiB")
    assert growth < RSS_GROWTH_MIB, f"the server's RSS grew by {growth:.0f} MiB"
    values = server.wait_metrics(lambda v: v["qrt_active_slots"] == 0 and v["qrt_queue_depth"] == 0)
    assert values["qrt_active_slots"] == 0 and values["qrt_queue_depth"] == 0


class Flood:
    """`count` long streaming requests sent at once, each on its own connection; the admitted
    stay open until close()."""

    BODY = {"model": NAME, "prompt": "flood", "max_tokens": MAX_SEQ_LEN - 16, "temperature": 0, "ignore_eos": True,
            "stream": True}

    def __init__(self, server, count: int):
        start = threading.Barrier(count)

        def send(_):
            client = httpx.Client(headers=HEADERS, timeout=httpx.Timeout(REPLY_TIMEOUT_S))
            start.wait(30)
            reply = client.send(client.build_request("POST", f"{server.url}/v1/completions", json=self.BODY),
                                stream=True)
            if reply.status_code != 200:
                reply.read()
            return client, reply

        with ThreadPoolExecutor(count) as pool:
            self.replies = list(pool.map(send, range(count)))
        self.admitted = [reply for _, reply in self.replies if reply.status_code == 200]
        self.refused = [reply for _, reply in self.replies if reply.status_code != 200]

    def close(self) -> None:
        for client, reply in self.replies:
            reply.close()
            client.close()


def _ended(values) -> float:
    return _outcome(values, "length") + _outcome(values, "stop") + _outcome(values, "error")


def _flood_and_hang_up(server, count: int) -> Flood:
    before = server.metrics()
    flood = Flood(server, count)
    try:
        during = server.metrics()
        # An admitted request that ended during the flood would have given its place to another.
        assert _ended(during) == _ended(before), "a flood request ended before the flood was in: make them longer"
        assert len(flood.admitted) == ROOM, [r.status_code for r in flood.refused]
        assert all(r.status_code == 503 and r.headers.get("retry-after") == "1"
                   and "queue is full" in r.json()["error"]["message"] for r in flood.refused)
        values = server.wait_metrics(lambda v: v["qrt_active_slots"] == SLOTS and v["qrt_queue_depth"] == MAX_QUEUE)
        assert (values["qrt_active_slots"], values["qrt_queue_depth"]) == (SLOTS, MAX_QUEUE)
    finally:
        flood.close()
    cancelled = _outcome(before, "cancelled") + ROOM
    values = server.wait_metrics(lambda v: v["qrt_active_slots"] == 0 and v["qrt_queue_depth"] == 0
                                 and _outcome(v, "cancelled") >= cancelled, timeout=30)
    assert (values["qrt_active_slots"], values["qrt_queue_depth"]) == (0, 0)
    assert _outcome(values, "cancelled") == cancelled and _ended(values) == _ended(before)
    return flood


def test_a_flood_admits_slots_plus_queue_and_hung_up_streams_give_their_places_back(server):
    _flood_and_hang_up(server, ROOM + 6)
    # The places the hung-up streams held are all free: the same flood again is admitted the same.
    _flood_and_hang_up(server, ROOM + 6)


def test_a_stream_whose_client_left_before_it_started_cancels_its_choices():
    """Under an ASGI server of spec 2.4, Starlette's first send (the response's start) raises when
    the client is gone, before the events' generator ever runs: its own `finally` never runs, so
    the response itself must cancel the choices."""
    running = [(Sequence(Request((1, 2), 8)), asyncio.Queue()) for _ in range(2)]
    response = delivery.streamed(running, reply=None, include_usage=False)  # the generator never runs

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    with pytest.raises(ClientDisconnect):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert all(seq.cancelled for seq, _ in running)
