"""Batch-1 decode speed against the length of the context it attends over, qrt beside llama.cpp, in
one run:

    python -m bench.context                                  # bf16, int4; contexts 32 and 2000
    python -m bench.context --quant bf16,fp8,int4,int8 --contexts 32,512,2000 --engines qrt,llama.cpp

Each decode step of a long context reads, beside the weights, every layer's K and V of every entry
so far; this shows what that costs. For each engine and format, one fresh process per context
(bench/engines.py, the suite's jobs): a prompt of that many tokens (the suite's fixed pseudo-random
ids), then --new-tokens greedy steps, timed from the first new token to the last, the median of
--runs runs [min–max]. Every context gets the same KV cache (the longest prompt + N + 1 entries), so
qrt compiles once per format and the later contexts load its compiled graphs. "× shortest": decode
at that context over decode at the shortest one, within this run. llama.cpp rows (the default
model's GGUFs, `make llama-cpp`) are timed as the suite times them: the bare step.
"""

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

from bench.tools.gguf_variants import default_model_ggufs
from bench.measure import (fmt_spread, log, machine_state, name_list, positive_int, print_machine_state,
                           print_table, prompt_ids)
from bench.quants import QUANTS
from bench.suite import Runner, resolve_model
from qrt.checkpoint.config import read_hf_config

ENGINES = ("qrt", "llama.cpp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default, 1b, moe or a checkpoint folder (bench/suite.py)")
    parser.add_argument("--quant", type=name_list(QUANTS), default="bf16,int4")
    parser.add_argument("--engines", type=name_list(ENGINES), default=",".join(ENGINES))
    parser.add_argument("--contexts", type=lambda text: sorted({positive_int(t) for t in text.split(",")}),
                        default=[32, 2000], help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, help="threads of every engine (default: torch's)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print_machine_state(machine_state())
    path, model_name, ggufs = resolve_model(args.model)
    vocab_size = read_hf_config(path)["vocab_size"]
    cache = max(args.contexts) + args.new_tokens + 1
    print(f"{model_name}: batch 1, contexts {', '.join(map(str, args.contexts))} tokens, {args.new_tokens} decode "
          f"steps, {args.runs} runs, {threads} threads, a KV cache of {cache} entries for every context")
    settings = argparse.Namespace(new_tokens=args.new_tokens, runs=args.runs)
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="qrt-context-") as work:
        work = Path(work)
        engines = []
        if "qrt" in args.engines:
            engines += [(f"qrt {name}", "qrt", {"quant": QUANTS[name]}, work / f"qrt-cache-{name}")
                        for name in args.quant]
        if "llama.cpp" in args.engines:
            if importlib.util.find_spec("llama_cpp") is None or args.model != "default":
                print("skipped: llama.cpp (needs llama-cpp-python and the default model's GGUFs)")
            else:
                engines += [(f"llama.cpp {gguf.stem.rsplit('.', 1)[-1]}", "llama.cpp", {"gguf": str(gguf)}, None)
                            for gguf in default_model_ggufs()]
        for label, kind, extra, qrt_cache in engines:
            speeds = {}
            for context in args.contexts:
                runner = Runner(path, [prompt_ids(vocab_size, context)], settings, threads, work)
                log(f"{label}: context {context}")
                figures = runner.job(kind, label, 1, qrt_cache=qrt_cache, cache_length=cache, **extra)
                if "error" in figures:
                    print(f"FAILED: {label} at context {context}: {figures['error']}")
                    failed = True
                speeds[context] = figures.get("decode_tok_s")
            rows.append((label, speeds))
    shortest = args.contexts[0]
    header = ("engine", *(f"decode tok/s @{c}" for c in args.contexts), *(f"@{c} × @{shortest}" for c in args.contexts[1:]))
    table = []
    for label, speeds in rows:
        base = speeds[shortest]["median"] if speeds[shortest] else None
        ratios = [f"{speeds[c]['median'] / base:.2f}" if base and speeds[c] else "—" for c in args.contexts[1:]]
        table.append((label, *(fmt_spread(speeds[c]) for c in args.contexts), *ratios))
    print()
    print_table(header, table)
    log("some jobs failed: see FAILED above" if failed else "context bench done")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
