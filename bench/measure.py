"""What the speed benchmarks (bench/decode.py, bench/suite.py) share: the prompt every engine gets,
the machine's state, timing, the spread of several runs, and plain-text tables.

torch is imported inside the functions that need it: bench/engines.py measures llama.cpp's peak
memory in a process that never loads torch."""

import argparse
import os
import statistics
import sys
import time

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
    }


def print_machine_state(state: dict) -> None:
    load1, load5, load15 = state["loadavg"]
    print(f"load average {load1:.2f} {load5:.2f} {load15:.2f}; torch threads {state['torch_threads']} "
          f"of {state['cpu_count']} CPUs; torch {state['torch']}, transformers {state['transformers']}")
    if load1 > BUSY_LOAD:
        print(f"WARNING: 1-minute load average {load1:.2f} > {BUSY_LOAD}: another job is using the CPUs, "
              f"and figures taken under load can be wrong by several times")


def prompt_ids(vocab_size: int, length: int, row: int = 0) -> list[int]:
    """The same pseudo-random prompt on every run and for every engine; `row` picks another prompt
    of the same length (the rows of a batch), row 0 being the batch-1 prompt."""
    import torch

    generator = torch.Generator().manual_seed(PROMPT_SEED + row)
    return torch.randint(FIRST_ORDINARY_TOKEN, vocab_size, (length,), generator=generator).tolist()


def wall_time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def timed_runs(fn, runs: int) -> list[float]:
    """Seconds of each of `runs` calls of fn, after one untimed call (warm caches, any recompile)."""
    fn()
    return [wall_time(fn) for _ in range(runs)]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def speeds(prefill_s: list[float], generate_s: list[float], prompt_tokens: int, new_tokens: int,
           batch: int = 1) -> dict:
    """Prefill and decode tokens/s of `batch` sequences from the seconds of generating 1 token
    (prefill_s) and new_tokens + 1 tokens (generate_s): each whole generate minus the *median*
    prefill, since prefill is short and noisy and pairing each run with its own would add that
    noise to every decode figure."""
    prefill_median = statistics.median(prefill_s)
    if min(generate_s) <= prefill_median:
        raise RuntimeError(f"a generate of {new_tokens + 1} tokens ({min(generate_s):.3f} s) took no longer than the "
                           f"median prefill ({prefill_median:.3f} s): the machine's noise exceeds the decode time, so "
                           f"no decode speed can be derived; use more new tokens")
    return {
        "prefill_tok_s": spread([batch * prompt_tokens / s for s in prefill_s]),
        "decode_tok_s": spread([batch * new_tokens / (s - prefill_median) for s in generate_s]),
        "prefill_s": prefill_s,
        "generate_s": generate_s,
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
