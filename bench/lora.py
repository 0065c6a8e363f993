"""What serving LoRA adapters costs: decode with an adapter against the base alone, a batch whose
rows use different adapters against one adapter for all, and the time to load an adapter into a
running model.

    python -m bench.lora                                  # default model, bf16, rank 16, 4 adapters
    python -m bench.lora PATH --quant int4 --rank 16 --adapters 4 --batch 8 --runs 3 --rounds 3
    python -m bench.lora --runs 1 --rounds 1 --new-tokens 8 --prompt-tokens 16   # smoke

Two models are compiled in one process from the same checkpoint: the base alone, and the base with
`--adapters` LoRA slots holding PEFT adapters of rank `--rank` on q/k/v/o/gate/up/down
(bench/tools/random_lora.py), both with `--batch` KV-cache slots. Each round times every row once
(each the median of --runs greedy generations after one untimed one), the rows one after another,
so that rows compared share the round; ratios are taken within a round and their median over the
rounds is reported, with the range.

Rows: base b1; the LoRA model at b1 with no adapter and with one; base b`--batch`; the LoRA model
at b`--batch` with one adapter for every row, and with the rows cycling through every adapter.
Loading: unload and load one adapter again, --runs times, in the running model (no recompile).
Run it on a quiet machine: another job on the two cores changes the figures by several times.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.measure import (decode_rate, fmt_ratio, fmt_spread, log, machine_state, positive_int, print_machine_state,
                           print_table, prompt_ids, spread)
from bench.quants import QUANTS


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="checkpoint folder (default: the default model)")
    parser.add_argument("--quant", choices=sorted(QUANTS), default="bf16")
    parser.add_argument("--rank", type=positive_int, default=16)
    parser.add_argument("--adapters", type=positive_int, default=4, help="adapters resident, each its own slot")
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--json", help="write every figure here")
    return parser.parse_args(argv)


def decode_tok_s(model, prompts: list[list[int]], adapters: list, new_tokens: int) -> float:
    """Decode tokens/s of one greedy generation of `prompts` together, row i with adapters[i]."""
    from qrt.runtime.sampling import SamplingParams

    stamps = [[] for _ in prompts]
    sequences = []
    for row, (ids, adapter) in enumerate(zip(prompts, adapters)):
        request = model.request(ids, new_tokens, SamplingParams(), stop_at_eos=False, lora=adapter)
        sequences.append(model.engine.submit(
            request, lambda update, row=row: stamps[row].append(update.time) if update.token is not None else None))
    model.engine.run(sequences)
    for seq in sequences:
        if seq.error is not None:
            raise seq.error
    return decode_rate(stamps)


def median_rate(model, prompts, adapters, args) -> float:
    decode_tok_s(model, prompts, adapters, args.new_tokens)  # untimed: warm caches
    return statistics.median(decode_tok_s(model, prompts, adapters, args.new_tokens) for _ in range(args.runs))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from bench.tools.random_lora import random_adapter
    from qrt import runtime
    from qrt.runtime.default_model import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.path) if args.path else default_model_path(progress=False)
    state = machine_state()
    print_machine_state(state)
    folders = {f"a{i}": random_adapter(path, args.rank, seed=i) for i in range(args.adapters)}
    common = dict(quant=QUANTS[args.quant], max_batch_size=args.batch, progress=False)
    log(f"compiling {path.name} {args.quant}, and with {args.adapters} adapters of rank {args.rank} …")
    base = runtime.compile_model(path, **common)
    lora = runtime.compile_model(path, **common, lora=folders, max_loras=args.adapters, max_lora_rank=args.rank)
    names = list(folders)
    one = [prompt_ids(base.vocab_size, args.prompt_tokens)]
    many = [prompt_ids(base.vocab_size, args.prompt_tokens, row) for row in range(args.batch)]
    rows = {  # label -> (model, prompts, adapter of each prompt)
        "base b1": (base, one, [None]),
        "LoRA model b1, no adapter": (lora, one, [None]),
        "LoRA model b1, one adapter": (lora, one, [names[0]]),
        f"base b{args.batch}": (base, many, [None] * args.batch),
        f"LoRA model b{args.batch}, one adapter for all": (lora, many, [names[0]] * args.batch),
        f"LoRA model b{args.batch}, {args.adapters} adapters": (lora, many, [names[i % len(names)]
                                                                            for i in range(args.batch)]),
    }
    rates = {label: [] for label in rows}
    for round_number in range(args.rounds):
        for label, (model, prompts, adapters) in rows.items():
            rates[label].append(median_rate(model, prompts, adapters, args))
        log(f"round {round_number + 1}: " + ", ".join(f"{label} {r[-1]:.1f}" for label, r in rates.items()))
    load_s = []
    for _ in range(args.runs):
        lora.unload_lora(names[-1])
        started = time.perf_counter()
        lora.load_lora(names[-1], folders[names[-1]])
        load_s.append(time.perf_counter() - started)
    ratios = {  # (row, against): the targets' comparisons, per round
        ("LoRA model b1, one adapter", "base b1"): None,
        ("LoRA model b1, no adapter", "base b1"): None,
        (f"LoRA model b{args.batch}, {args.adapters} adapters", f"LoRA model b{args.batch}, one adapter for all"): None,
        (f"LoRA model b{args.batch}, one adapter for all", f"base b{args.batch}"): None,
    }
    for row, against in ratios:
        per_round = [a / b for a, b in zip(rates[row], rates[against])]
        ratios[row, against] = {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}
    print_table(("row", "decode tok/s, median of rounds [range]"),
                [(label, fmt_spread(spread(r))) for label, r in rates.items()])
    print_table(("ratio", "median of rounds [range]"),
                [(f"{row} / {against}", f"{fmt_ratio(r['median'])} [{r['min']:.2f}–{r['max']:.2f}]")
                 for (row, against), r in ratios.items()])
    print(f"loading a rank-{args.rank} adapter into the running model: median {statistics.median(load_s):.3f} s "
          f"[{min(load_s):.3f}–{max(load_s):.3f}] over {len(load_s)} loads")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": state, "args": vars(args), "model": str(path), "rates": rates, "load_s": load_s,
            "ratios": [{"row": row, "against": against, **r} for (row, against), r in ratios.items()]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
