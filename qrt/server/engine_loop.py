"""The engine's own thread: it loads and compiles the model, then steps the engine while there is
work. Every torch call of the server happens on it; the HTTP side hands requests over and gets
each one's Updates back on its asyncio loop."""

import asyncio
import copy
import sys
import threading
import time
import traceback
from collections import deque

from qrt.runtime.engine import DEFAULT_CHUNK, ERROR, Engine, Request, Sequence, Update

from .lockstep import Leader
from .metrics import Metrics


class EngineLoop:
    def __init__(self, load, metrics: Metrics, *, chunk_size: int = DEFAULT_CHUNK, prefix_caching: bool = True,
                 on_fatal=None):
        """load(): the CompiledModel, compiled and warm (runs on the engine thread).
        on_fatal(message): called (on the engine thread) if loading fails, or if a sharded model's
        ranks can no longer step together."""
        self._load = load
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.prefix_caching = prefix_caching
        self._on_fatal = on_fatal
        self.model = None
        self.engine: Engine | None = None
        self.ready = threading.Event()
        self.load_error: str | None = None
        # Set when the engine can no longer step (a rank of a sharded model failed): the routes
        # answer 503 with it, and the server stops with a non-zero status.
        self.fault: str | None = None
        # Set by the first SIGTERM or Ctrl-C (drain.py): new requests are refused while those in
        # hand finish.
        self.draining = threading.Event()
        self._inbox: deque[Sequence] = deque()
        self._jobs: deque = deque()  # (fn, asyncio loop, future) to run on the engine thread (`call`)
        # Requests in hand (in the inbox, waiting for a slot, or in one) are counted by two
        # counters, each written by one thread: taken by the HTTP side as it submits, ended by the
        # engine thread as each request finishes. Their difference is what admission goes by.
        self._taken = 0
        self._ended = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="qrt-engine", daemon=True)

    # ---- the HTTP side ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def in_hand(self) -> int:
        """Requests accepted and not yet ended: running in a slot, or waiting for one.

        Admission goes by this count, against slots + queue places. It once went by the waiting
        requests alone (the inbox and the engine's queue) against the queue's places: a request
        bound for a free slot counts as waiting until the engine thread's next step moves it into
        the slot, and under a flood on an idle server the HTTP side takes requests far faster than
        that, so the first `--max-queue` requests filled the queue while the slots stood empty,
        and the rest were refused (24 requests against 4 slots and 8 places: 9 admitted;
        tests/test_server_limits.py's flood of 18: 8)."""
        return self._taken - self._ended

    def queue_depth(self) -> int:
        """Requests accepted but not yet in a slot."""
        return max(0, self.in_hand() - self.active_slots())

    def call(self, fn, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Run fn() on the engine thread between two engine steps (one call a step while requests
        run, so that a series of calls delays their tokens by one call at a time); its result, or
        its exception, arrives on the returned future, on `loop`. For torch work beside the
        engine's requests (embeddings): like every torch call of the server it runs on this one
        thread, never during a step (the compiled graphs, their weights and the CPU's thread pool
        are the engine's, and Dynamo's compiling is not thread-safe)."""
        future = loop.create_future()
        self._jobs.append((fn, loop, future))
        self._wake.set()
        return future

    def pending_calls(self) -> int:
        """Calls (`call`) not yet run."""
        return len(self._jobs)

    def _run_call(self) -> None:
        """The oldest waiting `call`, if any (engine thread)."""
        if not self._jobs:
            return
        fn, loop, future = self._jobs.popleft()
        try:
            result, error = fn(), None
        except Exception as err:  # noqa: BLE001  (a call's fault is its caller's answer, not the engine's)
            result, error = None, err
        loop.call_soon_threadsafe(_settle, future, result, error)

    def active_slots(self) -> int:
        return self.engine.active if self.engine is not None else 0

    def compiled_graphs(self) -> int:
        """Graphs Dynamo has compiled for the model so far (0 before it loads)."""
        return sum(self.model.compile_report().values()) if self.ready.is_set() else 0

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> tuple[Sequence, asyncio.Queue]:
        """Hand a request to the engine; its Updates arrive on the returned queue, on `loop`."""
        updates: asyncio.Queue = asyncio.Queue()
        first = [True]
        last_token_time = [0.0]

        def listener(update):  # engine thread
            if update.token is not None:
                if first[0]:
                    self.metrics.time_to_first_token.observe(update.time - seq.submitted)
                    first[0] = False
                else:
                    self.metrics.inter_token_latency.observe(update.time - last_token_time[0])
                last_token_time[0] = update.time
                self.metrics.generated_tokens.inc()
            if update.finish_reason is not None:
                self._ended += 1  # first: the place is free whatever happens to the answer
                self.metrics.requests.labels(outcome=update.finish_reason).inc()
            loop.call_soon_threadsafe(updates.put_nowait, update)

        seq = Sequence(request, listener)
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self._taken += 1
        self._inbox.append(seq)
        self._wake.set()
        return seq, updates

    def stop(self, timeout: float) -> None:
        """Finish the requests in hand, then end the thread (waits at most `timeout` s)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.model = self._load()
            # The engine detokenizes with a tokenizer of its own: the HTTP thread encodes prompts
            # with the model's, and a Rust tokenizer must not be used by two threads at once.
            tokenizer = copy.deepcopy(self.model.tokenizer)
            self.engine = Engine(self.model, chunk_size=self.chunk_size, tokenizer=tokenizer,
                                 prefix_caching=self.prefix_caching)
        except BaseException as err:  # noqa: BLE001  (reported, and the server shuts down)
            self.load_error = f"{type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
            if self._on_fatal is not None:
                self._on_fatal(self.load_error)
            return
        engine = self.engine
        # A sharded model: the other ranks run this engine too, told each round what changed.
        leader = Leader() if self.model.parallel.sharded else None
        self.ready.set()
        reused = engine.prefix_cache.reused_tokens
        while True:
            added = []
            while self._inbox:
                seq = self._inbox.popleft()
                try:
                    engine.add(seq)
                except Exception as err:  # noqa: BLE001  (one request's fault must not end the engine thread)
                    _refused(seq, err)
                    continue
                added.append(seq)
            self._run_call()
            last = self._stopping and not engine.has_work and not self._jobs
            dropped = None  # one process: the engine drops what is marked cancelled
            if leader is not None and (added or engine.has_work or last or leader.heartbeat_due()):
                try:
                    dropped = leader.send(engine, added, last=last)
                except Exception as err:  # noqa: BLE001  (another rank is gone: see _lose_the_group)
                    self._lose_the_group(engine, err)
                    return
            if engine.has_work:
                started = time.perf_counter()
                speculated = engine.speculation_counts()
                try:
                    engine.step(cancelled=dropped)
                except Exception as err:  # noqa: BLE001  (a fault outside any one request: end those in hand, go on)
                    traceback.print_exc(file=sys.stderr)
                    if leader is not None:
                        self._lose_the_group(engine, err)
                        return
                    engine.fail_all(err)
                self.metrics.step_seconds.observe(time.perf_counter() - started)
                self.metrics.prefix_reused_tokens.inc(engine.prefix_cache.reused_tokens - reused)
                reused = engine.prefix_cache.reused_tokens
                self.metrics.count_speculation(engine.speculation_counts(), speculated)
            elif last:
                return
            elif not self._jobs:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _lose_the_group(self, engine: Engine, err: BaseException) -> None:
        """A sharded model's collective failed (a rank died, or raised in its step, and its peers'
        reads saw the connection close): the ranks no longer hold the same state, and a later
        step would wait on a rank that is gone. End every request in hand with the fault, refuse
        the calls waiting, and stop the server rather than hang in a collective."""
        self.fault = f"a rank of the tensor-parallel group failed ({type(err).__name__}: {err})"
        print(f"qrt: error: {self.fault}; ending the requests in hand and shutting down", file=sys.stderr,
              flush=True)
        failure = RuntimeError(f"{self.fault}; the server is shutting down")
        engine.fail_all(failure)
        while self._inbox:
            _refused(self._inbox.popleft(), failure)
        while self._jobs:
            _, loop, future = self._jobs.popleft()
            loop.call_soon_threadsafe(_settle, future, None, failure)
        if self._on_fatal is not None:
            self._on_fatal(self.fault)


def _refused(seq: Sequence, err: BaseException) -> None:
    """End a request the engine would not take (its `add` raised): it never entered the engine,
    so the engine will not end it; its listener still hears that it ended."""
    seq.finish_reason, seq.error = ERROR, err
    try:
        seq.listener(Update(None, "", ERROR, time.perf_counter(), err))
    except Exception:  # noqa: BLE001  (as Engine._notify: a listener's fault is its own)
        pass


def _settle(future: asyncio.Future, result, error) -> None:
    """A call's outcome to its caller's future (on the caller's asyncio loop), unless the caller gave up."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
