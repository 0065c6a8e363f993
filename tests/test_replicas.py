"""`qrt serve --replicas 2`: two engine processes behind one front. The routing, the summed
metrics and the replicas' command line in this process; then (in `make test-slow`: each replica
loads the tiny chat model, and a killed one loads it again) a real front, whose answers must be
the one-process model's, which sends a shared prefix to one replica, which outlives a replica
killed with SIGKILL while it answers, and which drains on SIGTERM."""

import os
import signal
import sys
import time
from types import SimpleNamespace

import httpx2 as httpx
import openai
import pytest

from bench.serve_load import ServerProcess, free_port, metrics
from qrt.cli import replica_arguments, build_parser
from qrt.server.affinity import PrefixAffinity, prompt_prefix
from qrt.server.metrics import Metrics
from qrt.server.metrics_sum import summed_metrics
from test_server import KEY, MAX_SEQ_LEN, NAME, SLOTS, START_TIMEOUT_S, expected
from test_server_faults import Stream

REPLICAS = 2
PREFIX_CHARS = 64


def replicas(*in_flight):
    return [SimpleNamespace(index=i, in_flight=n, requests=0) for i, n in enumerate(in_flight)]


def test_a_prefix_goes_to_its_last_server_unless_that_one_is_a_batch_busier():
    affinity = PrefixAffinity(slack=4)
    pool = replicas(0, 0)
    first, key, hit = affinity.choose("shared system prompt", pool)
    assert not hit
    affinity.served(key, first, hit)
    pool[first.index].in_flight = 3  # busier, but by less than a batch
    again, key, hit = affinity.choose("shared system prompt", pool)
    assert (again, hit) == (first, True)
    affinity.served(key, again, hit)
    pool[first.index].in_flight = 4  # a whole batch more than the other: the other gets it
    other, key, hit = affinity.choose("shared system prompt", pool)
    assert other is not first and not hit
    affinity.served(key, other, hit)
    assert (affinity.hits, affinity.misses) == (1, 2)
    # The prefix's last server is now the other one; without it (restarting), the prefix goes elsewhere.
    only_first = [pool[first.index]]
    assert affinity.choose("shared system prompt", only_first)[2] is False
    # No prompt (GET /v1/models): the least busy replica, counted neither way.
    assert affinity.choose(None, pool)[1:] == (None, False)


def test_a_prompt_prefix_is_its_first_characters_chat_messages_as_json():
    assert prompt_prefix({"prompt": "abcdef"}, 4) == "abcd"
    assert prompt_prefix({"prompt": [1, 2, 3]}, 4) == "[1, "
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompt_prefix({"messages": messages}, 1000).startswith('[{"content": "Be brief.", "role": "system"}')
    assert prompt_prefix({"model": "x"}, 10) is None


def test_the_front_sums_every_sample_of_the_replicas_metrics():
    first, second = Metrics(), Metrics()
    for replica, stops in ((first, 2), (second, 3)):
        replica.requests.labels(outcome="stop").inc(stops)
        replica.slots.set(4)
        replica.time_to_first_token.observe(0.01 * stops)
    second.requests.labels(outcome="length").inc()
    text = summed_metrics([first.render().decode(), second.render().decode()]).decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['qrt_requests_total{outcome="stop"}'] == 5 and values['qrt_requests_total{outcome="length"}'] == 1
    assert values["qrt_slots"] == 8
    assert values["qrt_time_to_first_token_seconds_count"] == 2
    assert values['qrt_time_to_first_token_seconds_bucket{le="0.02"}'] == 1  # 0.02 s, not 0.03 s
    assert not any("_created" in name for name in values)


def test_a_replica_gets_the_fronts_serve_arguments_less_the_fronts_own():
    args = build_parser().parse_args(["--threads", "2", "serve", "path/to/model", "--host", "0.0.0.0", "--port", "9",
                                      "--replicas", "2", "--api-key", "secret", "--quant", "int4", "--max-batch", "4",
                                      "--no-prefix-caching", "--affinity-prefix-chars", "10"])
    assert replica_arguments(args.serve_parser, args) == ["path/to/model", "--quant", "int4", "--max-batch", "4",
                                                            "--no-prefix-caching"]
    args = build_parser().parse_args(["serve", "--replicas", "2"])
    assert replica_arguments(args.serve_parser, args) == ["default"]


class Front(ServerProcess):
    """`qrt serve --replicas 2` on the tiny chat model, with the slots and length of test_server's
    server (so that each replica finds chat_model's graphs in the run's compile cache)."""

    def __init__(self, folder, log_path):
        port = free_port()
        command = [sys.executable, "-m", "qrt", "--threads", str(REPLICAS), "serve", str(folder),
                   "--replicas", str(REPLICAS), "--affinity-prefix-chars", str(PREFIX_CHARS), "--port", str(port),
                   "--max-batch", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--api-key", KEY,
                   "--served-model-name", NAME]
        super().__init__(command, port, "/health", log_path)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def complete(self, prompt: str, max_tokens: int = 4) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                          json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})

    def wait_for(self, check, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            values = metrics(self.url)
            if check(values):
                return values
            assert time.monotonic() < deadline, (values, self.output()[-4000:])
            time.sleep(0.25)


@pytest.fixture(scope="module")
def front(chat_model, chat_llama_dir, tmp_path_factory):
    server = Front(chat_llama_dir, tmp_path_factory.mktemp("replicas") / "front.log")
    try:
        # The front answers at once; the replicas take seconds to load: a request now finds none ready.
        deadline = time.monotonic() + 60
        while True:
            try:
                server.before_ready = server.complete("too early")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.process.poll() is None, server.output()
                time.sleep(0.1)
        server.wait_ready(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.slow
def test_503_in_the_error_shape_until_the_replicas_are_ready(front):
    assert front.before_ready.status_code == 503 and front.before_ready.headers["retry-after"] == "1"
    error = front.before_ready.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "no_replica_ready")
    assert 503 in front.ready_codes and front.ready_codes[-1] == 200
    assert [r["state"] for r in front.health()["replicas"]] == ["ready"] * REPLICAS


@pytest.mark.slow
def test_answers_through_the_front_are_one_process_answers(front, client, chat_model):
    for prompt in ("The capital of France is", "Once upon a time"):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == expected(chat_model, chat_model.encode(prompt), 12)[0]
    messages = [{"role": "user", "content": "Tell me a story"}]
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=14, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text, tokens, reason = expected(chat_model, chat_model.encode_messages(messages), 14)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == reason and chunks[-1].usage.completion_tokens == tokens
    values = metrics(front.url)  # the replicas' counters, summed: every slot of both, these requests
    assert values["qrt_slots"] == REPLICAS * SLOTS
    assert values['qrt_requests_total{outcome="length"}'] + values.get('qrt_requests_total{outcome="stop"}', 0) >= 3


@pytest.mark.slow
def test_requests_sharing_a_prefix_go_to_the_replica_that_served_it(front):
    before = metrics(front.url)
    shared = "You are a helpful assistant. " * 4  # longer than --affinity-prefix-chars
    for tail in ("first question", "second question", "third question"):
        assert front.complete(shared + tail).status_code == 200
    after = metrics(front.url)
    routed = [after[f'qrt_router_requests_total{{replica="{i}"}}'] - before[f'qrt_router_requests_total{{replica="{i}"}}']
              for i in range(REPLICAS)]
    assert sorted(routed) == [0, 3]
    assert after["qrt_router_affinity_hits_total"] - before["qrt_router_affinity_hits_total"] == 2


def routed(values: dict) -> list[float]:
    return [values[f'qrt_router_requests_total{{replica="{i}"}}'] for i in range(REPLICAS)]


@pytest.mark.slow
def test_a_replica_killed_while_it_streams_cuts_only_its_own_streams_and_is_started_again(front):
    """SIGKILL to a replica with streams in flight on both: the victim's streams end short (no
    [DONE], as that replica's own would), none of them is sent again to the other replica, whose
    streams finish whole; new requests go around the victim until it is back."""
    before = routed(metrics(front.url))
    streams = [Stream(front.url, f"tale number {i}", 600) for i in range(4)]  # the least busy replica each
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60) and stream.lines, stream.error
    replicas = front.health()["replicas"]
    assert [r["in_flight"] for r in replicas] == [2, 2], replicas
    victim = replicas[0]
    os.kill(victim["pid"], signal.SIGKILL)
    for i in range(4):  # the first may reach the dead replica's port first: the front tries the other
        assert front.complete(f"still answered {i}").status_code == 200
    for stream in streams:
        stream.join(120)
        assert not stream.is_alive() and stream.error is None, stream.error
    whole = sum(stream.finished_whole() for stream in streams)
    assert whole == 2, [stream.lines[-1:] for stream in streams]
    # Each stream reached one replica once: the victim's two and the survivor's two, plus the
    # survivor's four completions above, and nothing sent again.
    assert [after - then for after, then in zip(routed(metrics(front.url)), before)] == [2, 2 + 4]
    values = front.wait_for(lambda v: v['qrt_router_replica_restarts_total{replica="0"}'] == 1
                            and v["qrt_router_replicas_ready"] == REPLICAS, START_TIMEOUT_S)
    assert values['qrt_router_replica_restarts_total{replica="1"}'] == 0
    replicas = front.health()["replicas"]
    assert replicas[0]["pid"] != victim["pid"] and replicas[1]["restarts"] == 0
    assert front.complete("after the restart").status_code == 200


@pytest.mark.slow
def test_sigterm_drains_the_front_then_stops_every_replica(front):
    """The front's first SIGTERM refuses new requests with 503 while the streams it relays run to
    their end; then it stops the replicas and exits 0."""
    pids = [r["pid"] for r in front.health()["replicas"]]
    streams = [Stream(front.url, f"story {i}", 1000) for i in range(3)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60) and stream.lines, stream.error
    os.killpg(front.process.pid, signal.SIGTERM)  # the front's group: the replicas have sessions of their own
    at_signal = [len(stream.lines) for stream in streams]
    deadline = time.monotonic() + 10
    while (refused := front.complete("late")).status_code == 200:  # taken before the signal was handled
        assert time.monotonic() < deadline, "the front took new requests 10 s after SIGTERM"
        time.sleep(0.05)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "shutting_down", refused.text
    assert httpx.get(front.url + "/health", timeout=10).json()["status"] == "stopping"
    for stream in streams:
        stream.join(120)
    for stream, before in zip(streams, at_signal):
        assert stream.finished_whole() and len(stream.lines) > before, (stream.error, stream.lines[-2:])
    assert front.process.wait(60) == 0
    assert front.stop() == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "qrt: server and replicas stopped" in front.log_path.read_text()
