"""Prefill and decode speed of qrt (bf16, online fp8) against `transformers` eager bf16, batch 1,
on one checkpoint, in one run.

    python -m bench.decode                                   # the default model, every engine
    python -m bench.decode PATH --quant bf16,fp8,int4,int8 --runs 5 --new-tokens 128 --prompt-tokens 32 \\
        --threads 2 --json out.json
    python -m bench.decode --runs 1 --new-tokens 4 --prompt-tokens 8 --quant bf16 --skip-hf  # smoke
    python -m bench.decode --checkpoint hf-fp8=/tmp/smol-fp8   # also a pre-quantized copy, as stored
    python -m bench.decode --checkpoint q4_1=path/to/model.Q4_1.gguf   # a GGUF file, in its own quantization
                                                              # (made by bench/tools/export_fp8.py)

Run it on a quiet machine: with two cores, another CPU-bound job slows 2-thread decode by several
times (the script prints the load average and warns when it is high). Every engine gets the same
prompt (fixed pseudo-random token ids, no special tokens), decodes greedily, and never stops at eos.
Models are measured one at a time: each is freed before the next is loaded.

Figures:
- load s: qrt: wall time of `compile_model(..., warmup=False)`: read the checkpoint, quantize or
  repack the weights, allocate the KV cache; nothing is compiled yet. transformers: `from_pretrained`.
- compile s: wall time of `CompiledModel.warmup()`, which compiles the prefill and decode graphs
  (the JSON also has `compile_seconds` per role). Inductor's on-disk cache would make a second
  run of this script compile much faster, so it points TORCHINDUCTOR_CACHE_DIR at a fresh temporary
  folder: the figure is a cold compile. Set TORCHINDUCTOR_CACHE_DIR yourself to use your own cache.
- prefill tok/s: prompt tokens / time of `generate(prompt, max_new_tokens=1)`: one prefill and one
  greedy sample (for transformers also its per-call setup of `generate`).
- decode tok/s: N / (time from the first new token to the last) of `generate(prompt,
  max_new_tokens=N + 1)`, with N = --new-tokens, timed as the tokens stream out (qrt's `stream=`,
  a transformers streamer): the N one-token steps after the first token, each a forward pass and
  a sample, and nothing of the prefill.
- Each figure is the median of --runs timed runs, after one untimed warm-up run, with [min–max].
- ×HF: decode tok/s over transformers eager's; ×bf16: each fp8 variant over qrt bf16.
- --checkpoint NAME=PATH adds a pre-quantized copy of the same model (a folder or a GGUF file), loaded as stored
  ("qrt NAME (stored)"); it should be the same model, or the comparison means nothing.
"""

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.measure import (check_length, fmt_ratio, fmt_spread, log, machine_state, name_list,
                           positive_int, print_machine_state, print_table, prompt_ids, speeds, timed_decodes,
                           timed_runs, TokenClock, TransformersClock, wall_time)
from qrt.checkpoint.config import read_hf_config
from bench.quants import QUANTS
from qrt.formats.catalog import online_formats

HF = "transformers eager bf16"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="checkpoint folder (default: the default model)")
    parser.add_argument("--quant", type=name_list(QUANTS), default=",".join(QUANTS),
                        help=f"comma-separated qrt variants: bf16 (weights as stored), {', '.join(online_formats())}")
    parser.add_argument("--runs", type=positive_int, default=5)
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="decode steps timed (N)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=32)
    parser.add_argument("--skip-hf", action="store_true", help="do not measure transformers eager")
    parser.add_argument("--checkpoint", action="append", default=[], type=named_path, metavar="NAME=PATH",
                        help="also measure this pre-quantized checkpoint as stored (repeatable)")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args()


def named_path(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not (Path(path).is_dir() or (Path(path).is_file() and path.endswith(".gguf"))):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH to a checkpoint folder or a .gguf file, got {text!r}")
    return name, Path(path)


def bench_qrt(path: Path, quant: str | None, engine: str, ids: list[int], args) -> dict:
    from qrt.runtime import compile_model

    log(f"{engine}: loading")
    started = time.perf_counter()
    model = compile_model(path, quant, warmup=False, progress=False)
    load_s = time.perf_counter() - started
    model.engine.prefix_caching = False  # each run prefills its (repeated) prompt whole, uncached
    log(f"{engine}: compiling")
    compile_s = wall_time(model.warmup)

    def prefill():
        check_length(model.generate(ids, max_new_tokens=1, stop_at_eos=False), 1, engine)

    def generate():
        clock = TokenClock()
        new_ids = model.generate(ids, max_new_tokens=args.new_tokens + 1, stop_at_eos=False, stream=clock.tick)
        check_length(new_ids, args.new_tokens + 1, engine)
        return clock.rows()

    log(f"{engine}: timing")
    result = {
        "engine": engine, "load_s": load_s, "compile_s": compile_s,
        "compile_seconds": dict(model.compile_seconds), "max_seq_len": model.max_seq_len,
        **speeds(timed_runs(prefill, args.runs), timed_decodes(generate, args.runs), len(ids)),
        # 1 graph per role: nothing recompiled after warmup(), so compile s is the whole cost.
        "graphs": model.compile_report(),
    }
    del model
    gc.collect()  # so the next model is measured with only itself in memory
    return result


def bench_hf(path: Path, ids: list[int], args) -> dict:
    from transformers import AutoModelForCausalLM

    log(f"{HF}: loading")
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    load_s = time.perf_counter() - started
    input_ids = torch.tensor([ids])
    attention_mask = torch.ones_like(input_ids)

    def run(new_tokens: int):
        # min_new_tokens keeps eos from ending generation early.
        clock = TransformersClock()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, streamer=clock)
        check_length(out[0, len(ids):], new_tokens, HF)
        return clock.rows()

    log(f"{HF}: timing")
    result = {
        "engine": HF, "load_s": load_s, "compile_s": None,
        **speeds(timed_runs(lambda: run(1), args.runs), timed_decodes(lambda: run(args.new_tokens + 1), args.runs),
                 len(ids)),
    }
    del model
    gc.collect()  # so the next model is measured with only itself in memory
    return result


def add_ratios(results: list[dict]) -> None:
    decode = {r["engine"]: r["decode_tok_s"]["median"] for r in results}
    for result in results:
        own = result["decode_tok_s"]["median"]
        result["vs_hf"] = own / decode[HF] if HF in decode and result["engine"] != HF else None
        is_fp8 = result["engine"].startswith("qrt") and result["engine"] != "qrt bf16"
        result["vs_qrt_bf16"] = own / decode["qrt bf16"] if is_fp8 and "qrt bf16" in decode else None


def print_results(results: list[dict]) -> None:
    header = ("engine", "load s", "compile s", "prefill tok/s", "decode tok/s", "×HF", "×bf16")
    print()
    print_table(header, [(
        r["engine"],
        f"{r['load_s']:.1f}",
        "—" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
        fmt_spread(r["prefill_tok_s"]),
        fmt_spread(r["decode_tok_s"]),
        fmt_ratio(r["vs_hf"]),
        fmt_ratio(r["vs_qrt_bf16"]),
    ) for r in results])
    for r in results:
        if "compile_seconds" in r:
            roles = ", ".join(f"{role} {s:.1f} s" for role, s in r["compile_seconds"].items())
            print(f"{r['engine']}: compiled {roles}; Dynamo graphs per role {r['graphs']} "
                  f"(more than 1: recompiled after warmup)")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fresh_cache = None
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        fresh_cache = tempfile.TemporaryDirectory(prefix="qrt-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh_cache.name
    state = machine_state()  # before loading anything: the load average of the machine as found
    print_machine_state(state)
    if args.path is None:
        from qrt.runtime.default_model import default_model_path

        path = default_model_path()
    else:
        path = Path(args.path)
    ids = prompt_ids(read_hf_config(path)["vocab_size"], args.prompt_tokens)
    print(f"{path}: prompt of {len(ids)} tokens, {args.new_tokens} decode steps, {args.runs} runs, "
          f"Inductor cache {'fresh' if fresh_cache else os.environ['TORCHINDUCTOR_CACHE_DIR']}")

    results = [bench_qrt(path, QUANTS[name], f"qrt {name}", ids, args) for name in args.quant]
    results += [bench_qrt(stored, None, f"qrt {name} (stored)", ids, args) for name, stored in args.checkpoint]
    if not args.skip_hf:
        results.append(bench_hf(path, ids, args))
    add_ratios(results)
    print_results(results)
    if args.json:
        report = {"machine": state, "path": str(path), "settings": vars(args), "prompt_ids": ids, "results": results}
        args.json.write_text(json.dumps(report, indent=2, default=str))  # default=str: paths
        print(f"wrote {args.json}")
    if fresh_cache:
        fresh_cache.cleanup()


if __name__ == "__main__":
    main()
