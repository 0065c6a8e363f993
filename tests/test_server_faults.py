"""Faults in the middle of work: a rank of `qrt serve --tp 2` dying during a stream, and SIGTERM
with several streams in flight. The server must answer what it holds and stop, never hang in a
collective, and a drain must finish every stream it took while refusing new requests."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest

from bench.serve_load import ServerProcess, free_port
from test_server import KEY, NAME, START_TIMEOUT_S

HEADERS = {"Authorization": f"Bearer {KEY}"}
EXIT_BOUND_S = 30  # what the server may take to stop after a rank died


class Stream(threading.Thread):
    """One streamed completion read line by line: `lines` as they come, `error` if the read failed."""

    def __init__(self, url: str, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.lines, self.error, self.status = [], None, None
        self.started = threading.Event()

    def run(self):
        body = {"model": NAME, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", headers=HEADERS, json=body,
                              timeout=httpx.Timeout(120, connect=10)) as reply:
                self.status = reply.status_code
                for line in reply.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as err:
            self.error = err
        finally:
            self.started.set()

    def finished_whole(self) -> bool:
        if len(self.lines) < 2 or self.lines[-1] != "data: [DONE]":
            return False
        last = json.loads(self.lines[-2][6:])  # a chunk, or an error event
        return bool(last.get("choices")) and last["choices"][0]["finish_reason"] == "length"


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
            parents[int(proc.name)] = int(proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker of this rank: the process below the launcher whose environment
    names the rank."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in descendants(launcher):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} below pid {launcher}")


@pytest.mark.slow  # two ranks compile the tiny model: `make test-slow`
def test_a_rank_that_dies_mid_stream_ends_the_stream_and_the_server(chat_llama_dir, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "qrt", "--threads", "1", "serve", str(chat_llama_dir),
               "--tp", "2", "--port", str(port), "--max-batch", "4", "--max-seq-len", "2048",
               "--api-key", KEY, "--served-model-name", NAME]
    server = ServerProcess(command, port, "/health", tmp_path / "server.log")
    try:
        server.wait_ready(START_TIMEOUT_S)
        stream = Stream(server.url, "a long tale", 1900)
        stream.start()
        assert stream.started.wait(60) and stream.lines, stream.error
        os.kill(rank_pid(server.process.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        stream.join(EXIT_BOUND_S)
        assert not stream.is_alive(), "the stream hung after a rank died"
        assert not stream.finished_whole(), "a stream of 1900 tokens cannot have finished"
        # The client learns of it: an error event in the stream, or the connection cut.
        assert stream.error is not None or any('"error"' in line for line in stream.lines), stream.lines[-3:]
        code = server.process.wait(max(1.0, EXIT_BOUND_S - (time.monotonic() - killed)))
        assert code != 0
    finally:
        server.stop()
    log = Path(tmp_path / "server.log").read_text()
    assert "rank" in log and "failed" in log, log[-3000:]


@pytest.mark.slow  # a server of its own, compiled: `make test-slow`
def test_sigterm_finishes_four_streams_and_refuses_new_requests(chat_llama_dir, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "qrt", "serve", str(chat_llama_dir), "--port", str(port), "--max-batch", "4",
               "--max-seq-len", "2048", "--api-key", KEY, "--served-model-name", NAME, "--shutdown-timeout", "120"]
    server = ServerProcess(command, port, "/health", tmp_path / "server.log")
    try:
        server.wait_ready(START_TIMEOUT_S)
        streams = [Stream(server.url, f"story {i}", 600) for i in range(4)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.started.wait(60) and stream.lines, stream.error
        os.killpg(server.process.pid, signal.SIGTERM)
        at_signal = [len(stream.lines) for stream in streams]
        # While it drains, a new request is refused in words, not dropped.
        refused = None
        for _ in range(50):
            try:
                refused = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=10,
                                     json={"model": NAME, "prompt": "late", "max_tokens": 4})
                if refused.status_code == 503:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert refused is not None and refused.status_code == 503, refused and refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        for stream in streams:
            stream.join(120)
        for stream, before in zip(streams, at_signal):
            assert stream.finished_whole() and len(stream.lines) > before, (stream.error, stream.lines[-2:])
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    assert "server stopped" in (tmp_path / "server.log").read_text()
