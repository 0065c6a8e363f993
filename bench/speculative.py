"""Decode speed with and without speculative decoding, on prompts whose answer repeats or edits
what the prompt gives (where prompt lookup pays) and on free text (where it must cost nothing).

    python -m bench.speculative                                   # default model, bf16 and int4, ngram
    python -m bench.speculative --quant bf16 --methods ngram,draft --draft-quant int4 --k 3,5 --json out.json
    python -m bench.speculative --runs 1 --new-tokens 16 --quant bf16 --workloads code  # smoke
    python -m bench.speculative PATH --quant bf16 --methods mtp --k 1,2   # a checkpoint with MTP layers

Each model is compiled once per method and k: {"method": "ngram", "num_speculative_tokens": k},
or {"method": "draft", "model": the same checkpoint, "quant": --draft-quant, ...}, or {"method":
"mtp"} (the checkpoint's own multi-token-prediction layer: DeepSeek-V3's); the same model
decodes every prompt both ways, through two engines over its one KV cache (one of them with
speculation off), alternating run by run, so both sides share the process, the weights and the
hour. Decoding is greedy and stops at the model's end of turn; the two sides must produce the
same tokens, and the script says so for every row (a mismatch would be a bug, not noise).

Figures, each the median of --runs timed runs after one untimed run, [min–max]:
- decode tok/s: tokens after the first / time from the first token to the last (bench/measure.py).
- ×: speculative over plain, within the run.
- tokens/check: the mean of 1 + the guesses kept, over the verify calls; guesses kept: kept / checked.
- checks/step: the share of decode steps that were verify calls (the rest found nothing to guess,
  or were resting after failed guesses).
Run it on a quiet machine: another job on the two cores changes the figures by several times.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.measure import (decode_rate, fmt_ratio, fmt_spread, log, machine_state, name_list,
                           positive_int, print_machine_state, print_table, spread)
from bench.quants import QUANTS

# A module to edit: the answer is the module again with one name changed.
CODE = '''import csv
from dataclasses import dataclass


@dataclass
class Reading:
    station: str
    day: str
    low: float
    high: float


def parse_row(row):
    station, day, low, high = row
    return Reading(station.strip(), day.strip(), float(low), float(high))


def load_readings(path):
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        next(reader)  # the header
        return [parse_row(row) for row in reader]


def warmest_day(readings, station):
    own = [r for r in readings if r.station == station]
    if not own:
        raise ValueError(f"no readings for {station}")
    return max(own, key=lambda r: r.high).day


def mean_range(readings):
    spans = [r.high - r.low for r in readings]
    return sum(spans) / len(spans)
'''

PASSAGE = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried two miles inland. "
    "Its keepers lived in a cottage at the foot of the tower and climbed its one hundred and twelve "
    "steps four times a night to wind the clockwork that turned the lens. In winter the spray froze "
    "on the gallery rail, and the keepers chipped it away with hammers so that the light would not "
    "be dimmed. The station was automated in 1968, and the cottage became a museum of the coast, "
    "where visitors can still see the logbooks in which each keeper wrote the weather, the ships "
    "that passed and the hours the lamp was lit."
)

WORKLOADS = {
    "code": f"Here is a Python module:\n\n```python\n{CODE}```\n\nRewrite the whole module with the function "
            f"parse_row renamed to read_row. Answer with the code only.",
    "passage": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    "free": "Write a short story about a fox who learns to sail a boat across a lake.",
}
GROUNDED = ("code", "passage")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="checkpoint folder (default: the default model)")
    parser.add_argument("--quant", type=name_list(QUANTS), default=["bf16", "int4"])
    parser.add_argument("--k", default="3", help="comma-separated num_speculative_tokens values, one model each")
    parser.add_argument("--methods", type=name_list(("ngram", "draft", "mtp")), default=["ngram"])
    parser.add_argument("--draft-quant", default="int4", help="draft: the quantized copy of the model that drafts")
    parser.add_argument("--workloads", type=name_list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--new-tokens", type=positive_int, default=160, help="at most this many tokens per answer")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--json", help="write every figure here")
    return parser.parse_args()


def decode_once(model, engine, ids: list[int], new_tokens: int):
    """One greedy answer through `engine`: (its tokens, the time of each as it arrived)."""
    from qrt.runtime.sampling import SamplingParams

    stamps = []  # each token's Update.time: the tokens of one step share it
    request = model.request(ids, new_tokens, SamplingParams())
    seq = engine.submit(request, lambda update: stamps.append(update.time) if update.token is not None else None)
    engine.run([seq])
    if seq.error is not None:
        raise seq.error
    return seq.tokens, stamps


def measure(model, ids: list[int], runs: int, new_tokens: int) -> dict:
    from qrt.runtime.engine import Engine

    plain, speculating = Engine(model, speculate=False), Engine(model)
    spec = speculating.speculator
    decode_once(model, plain, ids, new_tokens)  # untimed: warm caches
    decode_once(model, speculating, ids, new_tokens)
    rates = {"plain": [], "speculative": []}
    same, lengths, steps = True, [], 0
    before = (spec.proposed, spec.accepted, spec.checks)
    for _ in range(runs):
        tokens_plain, stamps = decode_once(model, plain, ids, new_tokens)
        rates["plain"].append(decode_rate([stamps]))
        tokens_spec, stamps = decode_once(model, speculating, ids, new_tokens)
        rates["speculative"].append(decode_rate([stamps]))
        same = same and tokens_plain == tokens_spec
        lengths.append(len(tokens_spec))
        steps += len(set(stamps[1:]))  # decode steps: each step's tokens share one time
    proposed, accepted, checks = (now - then for now, then in zip((spec.proposed, spec.accepted, spec.checks), before))
    ratios = [s / p for s, p in zip(rates["speculative"], rates["plain"])]
    return {
        "plain": spread(rates["plain"]), "speculative": spread(rates["speculative"]),
        "ratio": statistics.median(ratios), "ratios": ratios, "same_tokens": same, "tokens": lengths,
        "proposed": proposed, "accepted": accepted, "checks": checks, "steps": steps,
        "tokens_per_check": 1 + accepted / checks if checks else None,
        "kept_share": accepted / proposed if proposed else None,
        "checks_per_step": checks / steps if steps else None,
    }


def main() -> int:
    args = parse_args()
    import torch

    from qrt import runtime

    if args.threads:
        torch.set_num_threads(args.threads)
    state = machine_state()
    print_machine_state(state)
    results = []
    for quant in args.quant:
        for method in args.methods:
            for k in (int(text) for text in args.k.split(",")):
                spec = {"method": method, "num_speculative_tokens": k}
                if method == "draft":
                    spec |= {"model": args.path, "quant": QUANTS[args.draft_quant]}
                label = f"{quant} {f'{args.draft_quant} draft' if method == 'draft' else method} k={k}"
                log(f"compiling {label} …")
                model = runtime.compile_model(args.path, quant=QUANTS[quant], speculative=spec, progress=False)
                for name in args.workloads:
                    ids = model.encode_messages([{"role": "user", "content": WORKLOADS[name]}])
                    log(f"{label} {name}: {len(ids)} prompt tokens")
                    results.append({"quant": quant, "method": method, "label": label, "k": k, "workload": name,
                                    "prompt_tokens": len(ids), **measure(model, ids, args.runs, args.new_tokens)})
                del model
    rows = []
    for r in results:
        rows.append((f"{r['label']} {r['workload']}", str(r["prompt_tokens"]),
                     f"{statistics.median(r['tokens']):.0f}", fmt_spread(r["plain"]), fmt_spread(r["speculative"]),
                     fmt_ratio(r["ratio"]), fmt_ratio(r["tokens_per_check"]),
                     "—" if r["kept_share"] is None else f"{r['kept_share']:.0%}",
                     "—" if r["checks_per_step"] is None else f"{r['checks_per_step']:.0%}",
                     "yes" if r["same_tokens"] else "NO"))
    print_table(("model, workload", "prompt", "tokens", "plain tok/s", "speculative tok/s", "×", "tokens/check",
                 "guesses kept", "checks/step", "same tokens"), rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": state, "results": results}, indent=2))
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
