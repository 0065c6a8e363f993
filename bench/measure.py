"""What the speed benchmarks (bench/decode.py, bench/suite.py) share: the prompt every engine gets,
the machine's state, timing (seconds of whole runs, and the median µs of one kernel call that the
kernel probes report), the spread of several runs, and plain-text tables.

torch is imported inside the functions that need it: bench/engines.py measures llama.cpp's peak
memory in a process that never loads torch."""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

FIRST_ORDINARY_TOKEN = 10  # ids below this are special tokens (bos, eos, pad, chat markers)
PROMPT_SEED = 0
BUSY_LOAD = 0.5  # 1-minute load average above which the figures are not worth keeping


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def name_list(allowed):
    """An argparse type: a comma-separated, non-empty subset of `allowed`, in the order given."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or any(name not in allowed for name in names):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {list(allowed)}, got {text!r}")
        return names

    return parse


def machine_state() -> dict:
    import torch
    import transformers

    return {
        "loadavg": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_name(),  # the CPU varies between machines of one kind: every figure says which
        "date": time.strftime("%Y-%m-%d"),
    }


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo (and lscpu) gives it, or the platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def print_machine_state(state: dict) -> None:
    load1, load5, load15 = state["loadavg"]
    print(f"{state['date']}, {state['cpu']}; load average {load1:.2f} {load5:.2f} {load15:.2f}; "
          f"torch threads {state['torch_threads']} of {state['cpu_count']} CPUs; torch {state['torch']}, "
          f"transformers {state['transformers']}")
    if load1 > BUSY_LOAD:
        print(f"WARNING: 1-minute load average {load1:.2f} > {BUSY_LOAD}: another job is using the CPUs, "
              f"and figures taken under load can be wrong by several times")


def prompt_ids(vocab_size: int, length: int, row: int = 0) -> list[int]:
    """The same pseudo-random prompt on every run and for every engine; `row` picks another prompt
    of the same length (the rows of a batch), row 0 being the batch-1 prompt."""
    import torch

    generator = torch.Generator().manual_seed(PROMPT_SEED + row)
    return torch.randint(FIRST_ORDINARY_TOKEN, vocab_size, (length,), generator=generator).tolist()


def process_age() -> float | None:
    """Seconds since this process started (the kernel's record of it, so the interpreter's own
    start and every import count), to 10 ms; None where /proc is not there."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def wall_time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def timed_runs(fn, runs: int) -> list[float]:
    """Seconds of each of `runs` calls of fn, after one untimed call (warm caches, any recompile)."""
    fn()
    return [wall_time(fn) for _ in range(runs)]


RING_BYTES = 512 * 2**20  # far more than a CPU's last-level cache
RING_MOST = 4096  # copies at the most: enough to fill RING_BYTES with the smallest weight probed


def ring(make, nbytes: int) -> list:
    """Copies of the arguments make() returns (a tuple), `nbytes` each, for median_us to cycle
    through: as many as fill RING_BYTES, at least 2 and at most RING_MOST.

    A decode step reads each weight once, from memory. One weight called over and over stays in
    the CPU's cache, and its calls would be timed at the cache's speed; cycling through more bytes
    than the cache holds makes every call read its operands from memory, as in a model."""
    return [make() for _ in range(max(2, min(RING_MOST, RING_BYTES // nbytes)))]


def median_us(fn, operands=((),), calls: int = 200, warmup: int = 10) -> float:
    """Median microseconds of one call of fn(*operands[i]) over `calls` timed calls, after `warmup`
    untimed ones, each call taking the next entry of `operands` round the list: a ring(), or by
    default the same empty arguments every time (a closure over its operands, which stay cached)."""
    for i in range(warmup):
        fn(*operands[i % len(operands)])
    times = []
    for i in range(calls):
        args = operands[(warmup + i) % len(operands)]
        started = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def decode_rate(rows: list[list[float]]) -> float:
    """Decode tokens/s, timed directly: `rows` holds each sequence's token times (time.perf_counter()
    as each new token arrives; a batch stepping together may pass one list per sequence, the same
    list repeated). The decode span runs from the moment every sequence has its first token (its
    prefill is over) to the last token; the rate is the tokens made in it over its length."""
    start = max(row[0] for row in rows)
    end = max(row[-1] for row in rows)
    made = sum(1 for row in rows for stamp in row if stamp > start)
    if not made or end <= start:
        raise RuntimeError("no decode step was timed: generate at least 2 tokens per sequence")
    return made / (end - start)


def timed_decodes(run, runs: int) -> list[float]:
    """Decode tokens/s of each of `runs` calls of run(), which returns its sequences' token times
    (see decode_rate), after one untimed call (warm caches, any recompile)."""
    run()
    return [decode_rate(run()) for _ in range(runs)]


class TokenClock:
    """Token times of one generation, for engines that call back with each new token:
    `clock.tick` is the callback, `clock.rows(batch)` what decode_rate takes."""

    def __init__(self):
        self.stamps: list[float] = []

    def tick(self, *_token) -> None:
        self.stamps.append(time.perf_counter())

    def rows(self, batch: int = 1) -> list[list[float]]:
        return [self.stamps] * batch  # one stamp per step, for every sequence of the batch


class TransformersClock(TokenClock):
    """TokenClock as a transformers streamer: generate() puts the prompt first, then each step's
    new tokens."""

    def __init__(self):
        super().__init__()
        self.prompt_seen = False

    def put(self, _value) -> None:
        if self.prompt_seen:
            self.tick()
        self.prompt_seen = True

    def end(self) -> None:
        pass


def speeds(prefill_s: list[float], decode_tok_s: list[float], prompt_tokens: int, batch: int = 1) -> dict:
    """Prefill tokens/s of `batch` sequences from the seconds of generating their first token
    (prefill_s), and the decode tokens/s of timed_decodes."""
    return {
        "prefill_tok_s": spread([batch * prompt_tokens / s for s in prefill_s]),
        "decode_tok_s": spread(decode_tok_s),
        "prefill_s": prefill_s,
    }


def check_length(new_ids, expected: int, engine: str) -> None:
    # A generate that stopped early would pass for a faster one.
    if len(new_ids) != expected:
        raise RuntimeError(f"{engine}: generated {len(new_ids)} tokens, expected {expected}")


def print_table(header: tuple, rows: list[tuple]) -> None:
    """Columns aligned: the first to the left, the figures to the right."""
    rows = [header] + rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))


def fmt_spread(s: dict | None) -> str:
    return "—" if s is None else f"{s['median']:.1f} [{s['min']:.1f}–{s['max']:.1f}]"


def fmt_ratio(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
