"""Where a compiled prefill spends its time: the ops of one prompt, by self time.

    python -m bench.profiles.profile_prefill [checkpoint] [--quant fp8] [--prompt-tokens 512] [--threads 2]

Compiles the model (the default model without a checkpoint), times a few prefills of a random
prompt (medians printed), then profiles one with torch.profiler and prints the ops that took the
most self time. Run on a quiet machine.
"""

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qrt import runtime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", default=None)
    parser.add_argument("--quant", default=None, help="an online format (fp8, int4, int8, ...); none: as stored")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=12, help="ops listed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = runtime.compile_model(args.checkpoint, quant=args.quant, progress=False,
                                  max_seq_len=max(2048, args.prompt_tokens + 1))
    ids = torch.randint(10, model.vocab_size, (1, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.prefill(ids)  # compiles the prefill graph
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            model.prefill(ids)
            times.append(time.perf_counter() - started)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.prefill(ids)
    median = statistics.median(times)
    print(f"{args.quant or 'as stored'}: prefill of {args.prompt_tokens} tokens {median * 1e3:.1f} ms median of "
          f"{args.runs} [{min(times) * 1e3:.1f}–{max(times) * 1e3:.1f}], {args.prompt_tokens / median:.0f} tok/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
