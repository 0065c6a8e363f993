"""The engine processes behind `qrt serve --replicas N`: each a plain `qrt serve` on a free port of
127.0.0.1, watched through its /health. One that exits is started again (only that one), on a
fresh port; the router sends nothing to a replica that is not ready."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx2 as httpx

HEALTH_POLL_S = 0.5
HEALTH_TIMEOUT_S = 5
# A replica that keeps dying is started again after 1, 2, 4 … s, at most this long.
MAX_RESTART_DELAY_S = 30


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Replica:
    index: int
    process: subprocess.Popen | None = None
    port: int = 0
    state: str = "starting"  # starting | ready | down (exited or unreachable; a new one is on its way)
    started_at: float = 0.0
    restarts: int = 0
    ever_ready: bool = False
    failures_in_a_row: int = 0
    restart_at: float = 0.0
    in_flight: int = 0  # requests the router has sent it and not yet seen answered
    requests: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def describe(self) -> dict:
        return {"replica": self.index, "state": self.state, "pid": self.pid, "port": self.port,
                "restarts": self.restarts, "in_flight": self.in_flight}


@dataclass
class ReplicaPool:
    """command(port): the argv of one replica serving on `port`; env: its environment.
    start_timeout_s: a replica not ready this long after its start is killed and started again.
    on_fatal(message): a replica exited before any replica of the pool was ever ready (the model
    does not load: starting it again would only fail again)."""

    size: int
    command: object
    env: dict
    start_timeout_s: float
    on_fatal: object = None
    replicas: list[Replica] = field(default_factory=list)
    stopping: bool = False

    def __post_init__(self):
        self.replicas = [Replica(i) for i in range(self.size)]

    def start(self) -> None:
        for replica in self.replicas:
            self._spawn(replica)

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == "ready"]

    def in_flight(self) -> int:
        """Requests forwarded to a replica whose answers are not yet relayed to the end."""
        return sum(r.in_flight for r in self.replicas)

    def all_started_once(self) -> bool:
        return all(r.ever_ready for r in self.replicas)

    def mark_down(self, replica: Replica) -> None:
        """The router could not reach it: send it nothing until its /health answers again."""
        if replica.state == "ready":
            replica.state = "starting"

    def _spawn(self, replica: Replica) -> None:
        replica.port = free_port()
        # A session of its own: Ctrl-C in the front's terminal reaches the front alone, which then
        # stops every replica itself (after the requests in flight are answered).
        replica.process = subprocess.Popen(self.command(replica.port), env=self.env, start_new_session=True)
        replica.state, replica.started_at = "starting", time.monotonic()
        print(f"qrt: replica {replica.index} starting (pid {replica.pid}, port {replica.port})",
              file=sys.stderr, flush=True)

    async def watch(self) -> None:
        """Poll every replica until stopped: health, exits, restarts."""
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:
            while not self.stopping:
                await asyncio.gather(*(self._check(replica, client) for replica in self.replicas))
                await asyncio.sleep(HEALTH_POLL_S)

    async def _check(self, replica: Replica, client) -> None:
        if self.stopping:
            return
        now = time.monotonic()
        if replica.state == "down":
            if now >= replica.restart_at:
                replica.restarts += 1
                self._spawn(replica)
            return
        code = replica.process.poll()
        if code is None and replica.state == "starting" and now - replica.started_at > self.start_timeout_s:
            print(f"qrt: replica {replica.index} was not ready within {self.start_timeout_s:.0f} s; killing it",
                  file=sys.stderr, flush=True)
            _kill_group(replica.process, signal.SIGKILL)
            code = await asyncio.to_thread(replica.process.wait, 10)
        if code is not None:
            self._exited(replica, code)
            return
        try:
            healthy = (await client.get(replica.url + "/health")).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy and replica.process.poll() is None and not self.stopping:
            replica.state, replica.ever_ready, replica.failures_in_a_row = "ready", True, 0
        elif replica.state == "ready":
            replica.state = "starting"

    def _exited(self, replica: Replica, code: int) -> None:
        if self.stopping:
            return
        if not any(r.ever_ready for r in self.replicas) and self.on_fatal is not None:
            self.on_fatal(f"replica {replica.index} exited with status {code} before any replica was ready")
            return
        replica.failures_in_a_row += 1
        delay = min(MAX_RESTART_DELAY_S, 2 ** (replica.failures_in_a_row - 1))
        replica.state, replica.restart_at = "down", time.monotonic() + delay
        print(f"qrt: replica {replica.index} (pid {replica.pid}) exited with status {code}; starting it again "
              f"in {delay} s", file=sys.stderr, flush=True)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM to every replica (each drains its requests), SIGKILL to any still running after
        `timeout_s`."""
        self.stopping = True
        running = [r.process for r in self.replicas if r.process is not None and r.process.poll() is None]
        for process in running:
            _kill_group(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in running:
            try:
                await asyncio.to_thread(process.wait, max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(process, signal.SIGKILL)
                await asyncio.to_thread(process.wait, 10)


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def replica_env(threads: int) -> dict:
    """The environment of one replica: the front's, with its share of the CPU threads (OpenMP's
    pool is sized from OMP_NUM_THREADS before torch's own setting applies)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}
