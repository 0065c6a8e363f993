"""The time to a first token of several checkpoints (or GGUF files) compiled in one process, their
rounds alternating, so that a difference between them is not the machine's drift between
processes (the suite runs each file in a process of its own).

    python -m bench.profiles.prefill_side_by_side A.gguf B.gguf [--prompt-tokens 128] [--rounds 7]

Each round generates one token of the same random prompt on every model in turn (prefix caching
off, so every round prefills the whole prompt), through `generate` as the suite's prefill figure
does. Prints each round's milliseconds and each model's median, and the medians' ratios to the
first model's; then profiles one prefill of each by op. Run on a quiet machine.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qrt.runtime import compile_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=6, help="ops listed per profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for path in args.checkpoints:
        # The suite's cache length for its prompt and 64 new tokens: the same attention shapes.
        model = compile_model(path, max_seq_len=args.prompt_tokens + 65, max_batch_size=1, progress=False)
        model.engine.prefix_caching = False
        models[path.name] = model
    ids = torch.randint(10, min(m.vocab_size for m in models.values()), (args.prompt_tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    times = {name: [] for name in models}
    for round_index in range(args.rounds + 1):  # the first round warms every model up, untimed
        for name, model in models.items():
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=1, stop_at_eos=False)
            if round_index:
                times[name].append(time.perf_counter() - started)
    first = statistics.median(next(iter(times.values())))
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name}: {median * 1e3:.1f} ms median ({args.prompt_tokens / median:.0f} tok/s), "
              f"{median / first:.2f}x the first; rounds: {', '.join(f'{s * 1e3:.0f}' for s in seconds)}")
    for name, model in models.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.generate(ids, max_new_tokens=1, stop_at_eos=False)
        print(f"\n{name}, one prefill by op:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
