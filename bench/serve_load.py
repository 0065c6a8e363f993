"""Load on `qrt serve`: concurrent streaming clients with mixed prompt lengths, in one run.

    python -m bench.serve_load                                  # the default model, bf16
    python -m bench.serve_load --levels 1,8 --duration 20 --soak 0
    python -m bench.serve_load PATH --quant int4 --json bench/results/serve_load.json
    python -m bench.serve_load --levels 1,4,8,16 --soak 0 --chart docs/img/serve-load.png

It starts `qrt serve` (a fresh process on a free localhost port), then for each level of
concurrency runs that many clients for --duration seconds. Each client sends completions one
after another, streamed, greedy, with a prompt from the eval text of a length drawn from
--prompt-tokens and --max-tokens new tokens. Per level it reports:
- output tok/s: completion tokens of every request / the time from the start to the last one's end
  (no request starts after --duration; those running then finish);
- TTFT p50/p99: from sending a request to its first text;
- ITL p50/p99: between consecutive text chunks of one request (one chunk is one token unless a
  character spans tokens);
- TPOT p50: time per output token, a request's first text to its last over the tokens after
  the first, the median over requests (where a step sends several tokens at once, ITL's median
  can be a zero gap inside such a burst; TPOT counts every token);
- failures: any status but 200, a stream without [DONE], or a transport error.
Then a soak (--soak seconds, --soak-clients clients) of a mix of requests: streamed completions,
chat completions held to a JSON schema, completions with log-probabilities of the echoed prompt,
and streamed completions of long prompts (about three quarters of --max-seq-len); about
--cancel-rate of them are abandoned on purpose (streams closed after a few chunks, or
non-streaming requests whose client stops waiting). Each kept reply is checked (a stream ends in
[DONE], a schema reply that finished parses and has the schema's keys, the log-probabilities
cover every prompt and completion token). It counts failures, reads /metrics afterwards (every
slot must be free and the queue empty), and compares the server's resident memory (every process
of its group) at the end with that after --soak-warmup seconds of the same mix: the target is
within 5%.

With --shared-prefix N, every prompt starts with the same N tokens of text (a chat application's
system prompt), and with --compare-prefix-caching the levels run again on a server started with
--no-prefix-caching: the two rows of each level show what prefix caching saves, and the report
gives the prompt tokens the server did not prefill (`qrt_prefix_cache_reused_tokens`).

With --speculative ngram the qrt server decodes with speculation (prompt lookup, --num-speculative-
tokens guesses), and with --compare-speculative the levels run again on a server without it; the
report gives the guesses checked and kept.

With --replicas N the server is `qrt serve --replicas N` (N engine processes behind one front,
sharing --threads); the report gives how many requests the front sent to the replica that last
served their prompt's first --affinity-prefix-chars characters (with --shared-prefix, a prefix at
least that long makes every request after the first of each replica such a hit), and how many
went to each replica. --grounded makes every prompt a passage followed by its
own beginning, which the model goes on copying: the case prompt lookup is for. A step that keeps
guesses sends several chunks at once, so ITL counts the gaps a client sees, zeros included.

When llama-cpp-python's server is importable (`pip install 'llama-cpp-python[server]'`, see
`make llama-cpp`), the same levels run against `python -m llama_cpp.server` on the default model's
GGUF in the same precision (with --interrupt_requests False: its default ends a running request
when another arrives); otherwise that is skipped with a note. Every figure comes from this run.
The clients share the machine with the server: on a small machine they take some of its CPU.
"""

import argparse
import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the openai package's HTTP client, installed with the test extra

from bench.measure import machine_state, print_machine_state, print_table
from qrt.runtime.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"throughput_8_vs_1": 4.0, "ttft_p99_at_8_s": 2.0}
READY_TIMEOUT_S = 900
EVAL_TEXT = ROOT / "qrt" / "runtime" / "data" / "eval_text.txt"
CHARS_PER_TOKEN = 4  # English text in SmolLM2's tokenizer, near enough to pick prompt lengths


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the embedded model, bf16)")
    parser.add_argument("--quant", default=None, help="online quantization, as for qrt serve (default: bf16 as stored)")
    parser.add_argument("--levels", default="1,4,8,16", help="concurrent clients per level (default: 1,4,8,16)")
    parser.add_argument("--duration", type=float, default=30, help="seconds per level (default: 30)")
    parser.add_argument("--prompt-tokens", default="16,64,256", help="prompt lengths drawn from (default: 16,64,256)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of text every prompt starts with, before its own (default: 0)")
    parser.add_argument("--compare-prefix-caching", action="store_true",
                        help="run the levels again on a server with --no-prefix-caching")
    parser.add_argument("--speculative", choices=("ngram",), default=None, help="qrt serve --speculative")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--compare-speculative", action="store_true",
                        help="run the levels again on a qrt server without speculation")
    parser.add_argument("--grounded", action="store_true",
                        help="prompts that a completion goes on copying: a passage, then its beginning again")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="the server's slots, per replica (default: 8, as qrt serve)")
    parser.add_argument("--replicas", type=int, default=1, help="qrt serve --replicas (default: 1)")
    parser.add_argument("--affinity-prefix-chars", type=int, default=None,
                        help="qrt serve --affinity-prefix-chars, with --replicas (default: qrt's)")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--soak", type=float, default=300, help="soak seconds, 0 to skip (default: 300)")
    parser.add_argument("--soak-clients", type=int, default=8)
    parser.add_argument("--soak-warmup", type=float, default=60,
                        help="seconds of the soak's mix before its resident memory is taken as the baseline (default: 60)")
    parser.add_argument("--soak-long-tokens", type=int, default=None,
                        help="the soak's long prompts, in tokens of about 4 characters (default: three quarters "
                             "of --max-seq-len, less --max-tokens)")
    parser.add_argument("--cancel-rate", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads of each server, qrt's and llama.cpp's alike (default: every core)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp even when it is installed")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--chart", type=Path, default=None,
                        help="write a PNG of latency and throughput against load here (needs matplotlib)")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server in its own process group, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, command: list[str], port: int, ready_path: str, log_path: Path, env=None):
        self.port, self.url, self.ready_path, self.log_path = port, f"http://127.0.0.1:{port}", ready_path, log_path
        self.ready_codes: list[int] = []  # the status of every readiness poll that got an answer
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=env)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.output()}")
            try:
                self.ready_codes.append(httpx.get(self.url + self.ready_path, timeout=5).status_code)
                if self.ready_codes[-1] == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> int | None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def prompts(lengths: list[int], seed: int, shared_prefix: int = 0, grounded: bool = False):
    """Endless (prompt, most new tokens or None) from the eval text, each of a length drawn from
    `lengths` (in tokens, approximately), starting at a random place, after the text's first
    `shared_prefix` tokens (the same for every prompt). grounded: each passage is followed by a
    blank line and its own first quarter, so that the completion goes on copying it, and asks
    for at most the tokens left of the passage (its other three quarters): the answer is the
    copy, not free text after it (a 16-token passage leaves 12 to copy of --max-tokens 64)."""
    text = EVAL_TEXT.read_text(encoding="utf-8")
    prefix = text[:shared_prefix * CHARS_PER_TOKEN]
    rng = random.Random(seed)
    while True:
        size = rng.choice(lengths) * CHARS_PER_TOKEN
        start = rng.randrange(len(prefix), len(text) - size)
        passage = text[start:start + size]
        if grounded:
            yield prefix + f"{passage}\n\n{passage[:size // 4]}", max(1, (size - size // 4) // CHARS_PER_TOKEN)
        else:
            yield prefix + passage, None


class Client:
    """One client: requests back to back until `stop_at`. Records each request's outcome."""

    def __init__(self, url: str, model: str, lengths, max_tokens: int, seed: int, stop_at: float,
                 cancel_rate: float = 0.0, shared_prefix: int = 0, grounded: bool = False):
        self.url, self.model, self.max_tokens, self.stop_at = url, model, max_tokens, stop_at
        self.prompts = prompts(lengths, seed, shared_prefix, grounded)
        self.rng = random.Random(seed + 1)
        self.cancel_rate = cancel_rate
        self.records: list[dict] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < self.stop_at:
                prompt = next(self.prompts)
                if self.rng.random() < self.cancel_rate:
                    self.records.append(self.abandon(http, prompt))
                else:
                    self.records.append(self.keep(http, prompt))

    def keep(self, http, prompt: tuple[str, int | None]) -> dict:
        """A request not abandoned: here a streamed completion."""
        return self.stream(http, prompt)

    def body(self, prompt: tuple[str, int | None], stream: bool) -> dict:
        text, most = prompt
        body = {"model": self.model, "prompt": text, "max_tokens": min(self.max_tokens, most or self.max_tokens),
                "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def stream(self, http, prompt: tuple[str, int | None]) -> dict:
        record = {"sent": time.monotonic(), "ok": False, "chunks": [], "tokens": None}
        try:
            with http.stream("POST", self.url + "/v1/completions", json=self.body(prompt, True)) as reply:
                record["status"] = reply.status_code
                if reply.status_code != 200:
                    record["error"] = reply.read().decode(errors="replace")[:200]
                    return record
                for line in reply.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        record["ok"] = True
                        break
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        record["chunks"].append(time.monotonic())
                    if chunk.get("usage"):
                        record["tokens"] = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as err:
            record["error"] = f"{type(err).__name__}: {err}"
        record["done"] = time.monotonic()
        if record["tokens"] is None:  # a server that does not send usage: one chunk per token
            record["tokens"] = len(record["chunks"])
        return record

    def abandon(self, http, prompt: tuple[str, int | None]) -> dict:
        """A request given up on purpose: a stream closed after a few chunks, or a whole
        completion waited for only briefly."""
        record = {"sent": time.monotonic(), "abandoned": True}
        try:
            if self.rng.random() < 0.5:
                after = self.rng.randint(1, 20)
                with http.stream("POST", self.url + "/v1/completions", json=self.body(prompt, True)) as reply:
                    record["status"] = reply.status_code
                    for i, _ in enumerate(reply.iter_lines()):
                        if i >= after:
                            break
            else:
                record["status"] = http.post(self.url + "/v1/completions", json=self.body(prompt, False),
                                             timeout=self.rng.uniform(0.2, 2.0)).status_code
        except httpx.TimeoutException:
            record["status"] = "gave up"
        except httpx.HTTPError as err:
            record["error"] = f"{type(err).__name__}: {err}"
        return record


# The soak's structured requests: short values, so that a reply fits its max_tokens.
SOAK_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "kind", "good"],
               "properties": {"title": {"type": "string", "maxLength": 40},
                              "kind": {"enum": ["story", "report", "letter", "other"]},
                              "good": {"type": "boolean"}}}


class SoakClient(Client):
    """A soak client: each request it keeps is one of SOAK_KINDS, drawn at random, and its reply is
    checked; the rest (cancel_rate) are abandoned as Client abandons them."""

    def __init__(self, *args, long_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.long_prompts = prompts([long_tokens], self.rng.randrange(1 << 30))

    def keep(self, http, prompt: tuple[str, int | None]) -> dict:
        kind = self.rng.choice(SOAK_KINDS)
        record = getattr(self, kind)(http, prompt)
        record["kind"] = kind
        return record

    def long(self, http, prompt: tuple[str, int | None]) -> dict:
        """A streamed completion of a long prompt, drawn in place of `prompt`."""
        return self.stream(http, next(self.long_prompts))

    def structured(self, http, prompt: tuple[str, int | None]) -> dict:
        """A chat completion held to SOAK_SCHEMA; one that finished must parse and have its keys."""
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": "Describe this text as JSON: " + prompt[0][:600]}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "text", "schema": SOAK_SCHEMA}}}
        return self.checked(http, "/v1/chat/completions", body, check_schema_reply)

    def logprobs(self, http, prompt: tuple[str, int | None]) -> dict:
        """An echoed prompt scored with its top 5 alternatives, as lm-eval asks, and 8 new tokens."""
        body = {"model": self.model, "prompt": prompt[0], "max_tokens": 8, "temperature": 0, "echo": True,
                "logprobs": 5}
        return self.checked(http, "/v1/completions", body, check_logprobs_reply)

    def checked(self, http, path: str, body: dict, check) -> dict:
        record = {"sent": time.monotonic(), "ok": False, "chunks": [], "tokens": 0}
        try:
            reply = http.post(self.url + path, json=body)
            record["status"] = reply.status_code
            if reply.status_code != 200:
                record["error"] = reply.text[:200]
            else:
                payload = reply.json()
                record["error"] = check(payload)
                record["ok"] = record["error"] is None
                record["tokens"] = payload["usage"]["completion_tokens"]
        except (httpx.HTTPError, ValueError, KeyError) as err:
            record["error"] = f"{type(err).__name__}: {err}"
        record["done"] = time.monotonic()
        return record


def check_schema_reply(payload: dict) -> str | None:
    choice = payload["choices"][0]
    if choice["finish_reason"] != "stop":  # cut by max_tokens: a prefix of valid JSON, nothing to check
        return None
    try:
        value = json.loads(choice["message"]["content"])
    except ValueError as err:
        return f"schema reply is not JSON ({err}): {choice['message']['content'][:80]!r}"
    if not isinstance(value, dict) or set(value) != set(SOAK_SCHEMA["required"]):
        return f"schema reply has the wrong keys: {value!r:.80}"
    return None


def check_logprobs_reply(payload: dict) -> str | None:
    logprobs, usage = payload["choices"][0]["logprobs"], payload["usage"]
    expected = usage["prompt_tokens"] + usage["completion_tokens"]
    lengths = {len(logprobs[key]) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    if lengths != {expected}:
        return f"logprobs lists of lengths {sorted(lengths)} for {expected} tokens"
    if any(top is not None and not 1 <= len(top) <= 6 for top in logprobs["top_logprobs"]):
        return "a token with more alternatives than asked for"
    return None


SOAK_KINDS = ("stream", "structured", "logprobs", "long")


def run_clients(url: str, model: str, count: int, seconds: float, args, seed: int, cancel_rate: float = 0.0,
                mix: bool = False):
    """count clients for `seconds`; mix: SoakClients, with the soak's mix of requests."""
    start = time.monotonic()
    long_tokens = args.soak_long_tokens or args.max_seq_len * 3 // 4 - args.max_tokens
    extra = {"long_tokens": long_tokens} if mix else {}
    clients = [(SoakClient if mix else Client)(url, model, args.lengths, args.max_tokens, seed + 7919 * i,
                                               start + seconds, cancel_rate, args.shared_prefix, args.grounded,
                                               **extra) for i in range(count)]
    for client in clients:
        client.thread.start()
    for client in clients:
        client.thread.join(seconds + 600)
    return [r for c in clients for r in c.records], start, start + seconds


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(records: list[dict], start: float, end: float) -> dict:
    measured = [r for r in records if not r.get("abandoned")]
    failed = [r for r in measured if not r.get("ok")]
    # Clients start no request after `end`; the ones running then finish. Throughput: every
    # finished request's tokens over the time from the start to the last of them.
    finished = [r for r in measured if r.get("ok")]
    window = max([end] + [r["done"] for r in finished]) - start
    ttft = [r["chunks"][0] - r["sent"] for r in measured if r.get("ok") and r["chunks"]]
    itl = [b - a for r in measured if r.get("ok") for a, b in zip(r["chunks"], r["chunks"][1:])]
    # Time per output token: a request's first text to its last over the tokens between. Where a
    # step sends several tokens at once (speculative decoding), ITL's median can be a burst's
    # zero gap; this one counts every token.
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in measured
            if r.get("ok") and len(r["chunks"]) > 1 and r["tokens"] > 1]
    return {
        "requests": len(measured), "window_s": window, "failures": len(failed),
        "failure_examples": [r.get("error") or r.get("status") for r in failed[:3]],
        "output_tok_s": sum(r["tokens"] for r in finished) / window,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99), "tpot_p50_s": percentile(tpot, 50),
    }


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(qrt_[^\s#]+) ([0-9.e+-]+)$", text, re.M)}


def load_levels(url: str, model: str, args, engine: str) -> list[dict]:
    run_clients(url, model, 1, 0.1, args, seed=1)  # one untimed request: first-call costs out of the way
    rows = []
    for level in args.level_list:
        print(f"[serve_load] {engine}: {level} clients for {args.duration:.0f} s", file=sys.stderr, flush=True)
        records, start, end = run_clients(url, model, level, args.duration, args, seed=100 * level)
        rows.append({"engine": engine, "clients": level, **summarize(records, start, end)})
    return rows


def group_rss_mib(leader: int) -> float:
    """Resident memory of every process in the group `leader` leads (the server and its replicas or
    ranks), from /proc."""
    total_kib = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
            if int(fields[2]) != leader:
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while being read
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total_kib += int(match.group(1)) if match else 0
    return total_kib / 1024


def soak(url: str, model: str, args, server_pid: int) -> dict:
    print(f"[serve_load] soak: {args.soak_clients} clients, {args.soak_warmup:.0f} s of warm-up then "
          f"{args.soak:.0f} s, about {args.cancel_rate:.0%} of requests abandoned", file=sys.stderr, flush=True)
    warmup, _, _ = run_clients(url, model, args.soak_clients, args.soak_warmup, args, seed=998,
                               cancel_rate=args.cancel_rate, mix=True)
    rss_warm = group_rss_mib(server_pid)
    before = metrics(url)
    samples = []  # (seconds into the soak, resident MiB), every 30 s
    done = threading.Event()

    started = time.monotonic()

    def sample_rss():
        while not done.wait(30):
            samples.append((round(time.monotonic() - started), round(group_rss_mib(server_pid), 1)))
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    records, start, end = run_clients(url, model, args.soak_clients, args.soak, args, seed=999,
                                      cancel_rate=args.cancel_rate, mix=True)
    done.set()
    deadline = time.monotonic() + 30
    after = metrics(url)
    while (after["qrt_active_slots"] or after["qrt_queue_depth"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = metrics(url)
    rss_end = group_rss_mib(server_pid)
    abandoned = [r for r in records if r.get("abandoned")]
    summary = summarize(records, start, end)
    kinds = {kind: {"requests": sum(r.get("kind") == kind for r in records),
                    "failures": sum(r.get("kind") == kind and not r.get("ok") for r in records)}
             for kind in SOAK_KINDS}
    outcomes = {k.split('"')[1]: v - before.get(k, 0) for k, v in after.items() if k.startswith("qrt_requests_total")}
    return {"seconds": args.soak, "clients": args.soak_clients, "warmup_s": args.soak_warmup,
            "warmup_failures": sum(not r.get("ok") for r in warmup if not r.get("abandoned")),
            "abandoned": len(abandoned), "abandoned_errors": [r["error"] for r in abandoned if r.get("error")][:3],
            "requests": summary["requests"], "failures": summary["failures"], "kinds": kinds,
            "failure_examples": summary["failure_examples"], "outcomes_from_metrics": outcomes,
            "active_slots_after": after["qrt_active_slots"], "queue_depth_after": after["qrt_queue_depth"],
            "slots": after["qrt_slots"], "rss_after_warmup_mib": rss_warm, "rss_end_mib": rss_end,
            "rss_samples": samples}


def qrt_server(args, log_dir: Path, prefix_caching: bool = True, speculative: bool = True) -> tuple[ServerProcess, str]:
    port = free_port()
    # The embedded model as its bf16 folder, as the rows of bf16 and --quant compare from.
    model = args.model or str(default_model_path(progress=False))
    command = [sys.executable, "-m", "qrt", "--threads", str(args.threads), "serve", model,
               "--port", str(port), "--max-batch", str(args.max_batch), "--max-seq-len", str(args.max_seq_len),
               "--max-queue", "256", "--served-model-name", "bench"]
    if args.quant:
        command += ["--quant", args.quant]
    if args.replicas != 1:
        command += ["--replicas", str(args.replicas)]
        if args.affinity_prefix_chars is not None:
            command += ["--affinity-prefix-chars", str(args.affinity_prefix_chars)]
    if not prefix_caching:
        command += ["--no-prefix-caching"]
    if args.speculative and speculative:
        command += ["--speculative", args.speculative, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    log = "qrt-serve.log" if prefix_caching and speculative else \
        f"qrt-serve-no-{'prefix-caching' if not prefix_caching else 'speculation'}.log"
    return ServerProcess(command, port, "/health", log_dir / log), "bench"


def peer_gguf(args) -> tuple[Path | None, str]:
    """The default model's GGUF in the precision qrt serves, or why there is none."""
    if args.model is not None:
        return None, "llama.cpp runs only on the default model here (its GGUF ships with it)"
    from bench.tools.gguf_variants import default_model_ggufs

    # The default model's GGUFs (bench/tools/gguf_variants.py): its own Q4_1 and the BF16 and Q8_0 made from it.
    wanted = {None: "BF16", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1"}.get(args.quant)
    for gguf in default_model_ggufs():
        if wanted and wanted in gguf.name:
            return gguf, ""
    return None, f"no {wanted or args.quant} GGUF of the default model to compare with"


def llama_cpp_server(gguf: Path, args, log_dir: Path) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(args.max_seq_len), "--n_threads", str(args.threads),
               "--model_alias", "bench",
               # Its default lets every new request interrupt the running one (ending it after a
               # token or two); off, requests wait their turn, which is how it serves many clients.
               "--interrupt_requests", "False"]
    return ServerProcess(command, port, "/v1/models", log_dir / "llama-cpp-server.log")


def routing(served: dict[str, float]) -> dict:
    """The front's affinity counters: requests sent to their prefix's last replica, and per replica."""
    hits, misses = served["qrt_router_affinity_hits_total"], served["qrt_router_affinity_misses_total"]
    per_replica = {int(re.search(r'replica="(\d+)"', k).group(1)): v for k, v in served.items()
                   if k.startswith("qrt_router_requests_total")}
    return {"affinity_hits": hits, "affinity_misses": misses,
            "affinity_hit_rate": hits / (hits + misses) if hits + misses else None,
            "requests_per_replica": [per_replica[i] for i in sorted(per_replica)],
            "restarts": sum(v for k, v in served.items() if k.startswith("qrt_router_replica_restarts_total"))}


def print_report(report: dict) -> None:
    rows = []
    for row in report["levels"]:
        def ms(v):
            return "-" if v is None else f"{v * 1000:.0f}"
        rows.append((row["engine"], str(row["clients"]), f"{row['output_tok_s']:.1f}", ms(row["ttft_p50_s"]),
                     ms(row["ttft_p99_s"]), ms(row["itl_p50_s"]), ms(row["itl_p99_s"]), ms(row["tpot_p50_s"]),
                     str(row["requests"]), str(row["failures"])))
    print_table(("engine", "clients", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                 "TPOT p50 ms", "requests", "failures"), rows)
    for check, verdict in report["targets"].items():
        print(f"target {check}: {verdict}")
    if report.get("soak"):
        s = report["soak"]
        print(f"soak: {s['requests']} measured requests + {s['abandoned']} abandoned over {s['seconds']:.0f} s with "
              f"{s['clients']} clients: {s['failures']} failures; afterwards {s['active_slots_after']:.0f} of "
              f"{s['slots']:.0f} slots busy, queue {s['queue_depth_after']:.0f}; outcomes {s['outcomes_from_metrics']}")
        print("soak requests by kind: " + ", ".join(f"{kind} {v['requests']} ({v['failures']} failed)"
                                                    for kind, v in s["kinds"].items()))
        print(f"soak resident memory of the server: {s['rss_after_warmup_mib']:.1f} MiB after {s['warmup_s']:.0f} s "
              f"of warm-up, {s['rss_end_mib']:.1f} MiB at the end "
              f"({s['rss_end_mib'] / s['rss_after_warmup_mib'] - 1:+.1%})")
    if report.get("prompt_tokens"):
        print(f"prefix caching: {report['prefix_cache_reused_tokens']:.0f} of {report['prompt_tokens']:.0f} prompt "
              f"tokens sent to qrt were not prefilled (whole chunks a free slot held)")
    if report.get("speculative_proposed"):
        print(f"speculative decoding: {report['speculative_accepted']:.0f} of {report['speculative_proposed']:.0f} "
              f"guesses kept")
    if report.get("routing"):
        r = report["routing"]
        rate = "-" if r["affinity_hit_rate"] is None else f"{r['affinity_hit_rate']:.0%}"
        print(f"replicas: {r['affinity_hits']:.0f} of {r['affinity_hits'] + r['affinity_misses']:.0f} requests went to "
              f"the replica that last served their prompt's prefix (affinity hit rate {rate}); requests per replica "
              f"{', '.join(f'{n:.0f}' for n in r['requests_per_replica'])}; {r['restarts']:.0f} restarts")
    for note in report["notes"]:
        print(f"note: {note}")


def judge(report: dict) -> dict:
    qrt = {row["clients"]: row for row in report["levels"] if row["engine"] == "qrt"}
    verdicts = {}
    if 1 in qrt and 8 in qrt and qrt[1]["output_tok_s"]:
        ratio = qrt[8]["output_tok_s"] / qrt[1]["output_tok_s"]
        verdicts["throughput 8 clients / 1 client ≥ 4"] = f"{ratio:.2f}× ({'met' if ratio >= 4 else 'MISSED'})"
    if 8 in qrt and qrt[8]["ttft_p99_s"] is not None:
        p99 = qrt[8]["ttft_p99_s"]
        verdicts["TTFT p99 at 8 clients ≤ 2 s"] = f"{p99:.2f} s ({'met' if p99 <= 2 else 'MISSED'})"
    soak_result = report.get("soak")
    if soak_result:
        clean = soak_result["failures"] == 0 and soak_result["active_slots_after"] == 0 \
            and soak_result["queue_depth_after"] == 0
        verdicts["soak: no failures, every slot free"] = "met" if clean else "MISSED"
        growth = soak_result["rss_end_mib"] / soak_result["rss_after_warmup_mib"] - 1
        verdicts["soak: resident memory at the end within 5% of after warm-up"] = \
            f"{growth:+.1%} ({'met' if growth <= 0.05 else 'MISSED'})"
    return verdicts


def main(argv=None) -> int:
    args = parse_args(argv)
    args.level_list = [int(x) for x in args.levels.split(",")]
    args.lengths = [int(x) for x in args.prompt_tokens.split(",")]
    log_dir = ROOT / "bench" / "results"
    log_dir.mkdir(parents=True, exist_ok=True)
    state = machine_state()
    print_machine_state(state)
    report = {"machine": state, "args": {k: v for k, v in vars(args).items() if k != "lengths"},
              "levels": [], "notes": []}
    server, name = qrt_server(args, log_dir)
    with server:
        report["qrt_ready_s"] = server.wait_ready()
        report["levels"] += load_levels(server.url, name, args, "qrt")
        served = metrics(server.url)
        report["prompt_tokens"] = served.get("qrt_prompt_tokens_total", 0.0)
        report["prefix_cache_reused_tokens"] = served.get("qrt_prefix_cache_reused_tokens_total", 0.0)
        report["speculative_proposed"] = served.get("qrt_speculative_proposed_tokens_total", 0.0)
        report["speculative_accepted"] = served.get("qrt_speculative_accepted_tokens_total", 0.0)
        if args.replicas != 1:
            report["routing"] = routing(served)
        if args.soak > 0:
            report["soak"] = soak(server.url, name, args, server.process.pid)
    report["qrt_exit_code_after_sigterm"] = server.process.returncode
    if args.compare_prefix_caching:
        uncached, name = qrt_server(args, log_dir, prefix_caching=False)
        with uncached:
            uncached.wait_ready()
            report["levels"] += load_levels(uncached.url, name, args, "qrt, no prefix caching")
    if args.compare_speculative:
        plain, name = qrt_server(args, log_dir, speculative=False)
        with plain:
            plain.wait_ready()
            report["levels"] += load_levels(plain.url, name, args, "qrt, no speculation")
    if args.no_peer:
        report["notes"].append("llama.cpp skipped (--no-peer)")
    elif importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llama_cpp.server") is None:
        report["notes"].append("llama.cpp skipped: llama-cpp-python[server] is not installed (`make llama-cpp`, "
                               "then `pip install 'llama-cpp-python[server]'`)")
    else:
        gguf, why = peer_gguf(args)
        if gguf is None:
            report["notes"].append(f"llama.cpp skipped: {why}")
        else:
            with llama_cpp_server(gguf, args, log_dir) as peer:
                peer.wait_ready()
                report["levels"] += load_levels(peer.url, "bench", args, "llama.cpp")
            report["notes"].append(f"llama.cpp: python -m llama_cpp.server on {gguf.name}")
    report["targets"] = judge(report)
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))  # default=str: the chart's path
    if args.chart:
        write_chart(report, args.chart)
    return 0


def write_chart(report: dict, path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print('note: no chart: matplotlib is not installed (pip install -e ".[bench]")')
        return
    from bench.tools.load_chart import write_load_chart

    machine = report["machine"]
    title = (f"qrt serve --max-batch {report['args']['max_batch']}: {report['args']['duration']:.0f} s per level, "
             f"{machine.get('cpu', 'CPU')}, {machine.get('date', '')}")
    write_load_chart(report["levels"], path, title)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
