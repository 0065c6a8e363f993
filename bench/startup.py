"""Start-up of qrt, in one run: cold and warm time to the first token, decode speed against the
frozen whole-graph build, peak memory against transformers, and compile time against depth.

    python -m bench.startup                                  # the default model, every format, both builds
    python -m bench.startup --quant bf16,int4 --builds regional --runs 3
    python -m bench.startup --depth-only                     # only the compile-time-against-depth table

Every measurement is a fresh process (bench/engines.py says exactly what each figure times), one
after another, so run it on a quiet machine. For each format and build:
- cold: an empty QRT_CACHE_DIR (no qrt compile cache, no Inductor caches): first token s = load +
  every compile generate needs + the first token, from the call of compile_model (imports not
  counted), and the same token from the process's start (Python and the imports included: what
  the targets are set on); then decode at batch 1 (median of --runs after an untimed run) and the peak RSS of the
  whole process (imports, load, compile and the decode runs: VmHWM);
- warm: a second process on that folder: first token s as above (the regional build loads its
  graphs from qrt's compile cache; the frozen build, with --frozen-warm, gets what Inductor's own
  caches serve: minutes per format, so it is off by default);
- batch 8: a third process on that folder (`max_batch_size=8`, `generate_batch`).
Then transformers eager bf16 at batch 1 for its peak RSS. The depth table compiles (cold, regional
bf16) the default model and the 0.85B Llama's shape with 16 and 60 layers, with random weights
(load_format="dummy": compile time does not depend on the values).
"""

import argparse
import json
import tempfile
from pathlib import Path

from bench.measure import (fmt_ratio, fmt_spread, machine_state, name_list, positive_int,
                           print_machine_state, print_table, prompt_ids)
from bench.quants import QUANTS
from bench.suite import HF_EAGER, Runner, resolve_model
from qrt.checkpoint.config import read_hf_config

BUILDS = ("regional", "frozen")
DEPTHS = (16, 60)
TARGETS = {"cold_s": 30.0, "warm_s": 5.0, "decode_vs_frozen": 0.95, "depth_ratio": 1.25}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default, 1b or a checkpoint folder")
    parser.add_argument("--quant", type=name_list(QUANTS), default="bf16,fp8,int4,int8,w8a8")
    parser.add_argument("--builds", type=name_list(BUILDS), default=",".join(BUILDS))
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="decode steps timed")
    parser.add_argument("--prompt-tokens", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--frozen-warm", action="store_true",
                        help="also time a warm start of the frozen build (minutes per format; not served by a cache)")
    parser.add_argument("--no-depth", action="store_true", help="skip the compile-time-against-depth table")
    parser.add_argument("--depth-only", action="store_true", help="only the compile-time-against-depth table")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def median(figure: dict | None) -> float | None:
    return None if not figure else figure["median"]


def start_rows(runner: Runner, args) -> list[dict]:
    rows = []
    for name in args.quant:
        for build in args.builds:
            warm = build == "regional" or args.frozen_warm
            rows.append(runner.qrt(name, build, warm=warm) | {"build": build})
    eager = runner.job("transformers", HF_EAGER, 1)
    rows.append({"label": HF_EAGER, "build": None, "format": "bf16", "first_token_s": None,
                 "warm_first_token_s": None, "process_first_token_s": None, "warm_process_first_token_s": None,
                 "decode_tok_s": {"1": eager.get("decode_tok_s"), str(args.batch): None},
                 "peak_rss_mib": {"1": eager.get("peak_rss_mib")},
                 "errors": [eager["error"]] if "error" in eager else [], "jobs": {"batch 1": eager}})
    return rows


def depth_rows(runner: Runner, args, work: Path) -> list[dict]:
    """Cold regional bf16 compile time of the default model, and of the 0.85B Llama's shape with
    16 and 60 layers (dummy weights), each in a fresh cache folder."""
    from bench.tools.random_llama import LLAMA_1B

    rows = []
    default_job = runner.job("qrt-start", "default model", 1, qrt_cache=work / "depth-default", quant="none",
                             build="regional")
    rows.append({"label": "default model (30 layers)", "job": default_job})
    for layers in DEPTHS:
        folder = work / f"llama-1b-{layers}-layers"
        folder.mkdir()
        config = {**LLAMA_1B, "num_hidden_layers": layers, "architectures": ["LlamaForCausalLM"],
                  "model_type": "llama", "torch_dtype": "bfloat16"}
        (folder / "config.json").write_text(json.dumps(config))
        job = runner.job("qrt-start", f"0.85B shape, {layers} layers", 1, qrt_cache=work / f"depth-{layers}",
                         quant=None, build="regional", load_format="dummy", path=str(folder),
                         prompts=[prompt_ids(LLAMA_1B["vocab_size"], args.prompt_tokens)])
        rows.append({"label": f"0.85B Llama shape, {layers} layers (random weights)", "job": job})
    base = default_job.get("compile_s")
    for row in rows:
        compile_s = row["job"].get("compile_s")
        row["compile_s"] = compile_s
        row["vs_default"] = compile_s / base if compile_s and base else None
    return rows


def print_start_table(rows: list[dict], batch: int) -> None:
    frozen = {row["format"]: row for row in rows if row.get("build") == "frozen"}
    eager_rss = next((row["peak_rss_mib"]["1"] for row in rows if row["label"] == HF_EAGER), None)
    table = []
    for row in rows:
        base = frozen.get(row["format"]) if row.get("build") == "regional" else None
        ratios = [fmt_ratio(median(row["decode_tok_s"].get(b)) / median(base["decode_tok_s"].get(b)))
                  if base and median(row["decode_tok_s"].get(b)) and median(base["decode_tok_s"].get(b)) else "—"
                  for b in ("1", str(batch))]
        rss = row["peak_rss_mib"].get("1")
        row["vs_frozen"] = dict(zip(("1", str(batch)), ratios))
        table.append((row["label"],
                      *(f"{row[key]:.1f}" if row.get(key) else "—"
                        for key in ("first_token_s", "warm_first_token_s", "process_first_token_s",
                                    "warm_process_first_token_s")),
                      fmt_spread(row["decode_tok_s"].get("1")), ratios[0],
                      fmt_spread(row["decode_tok_s"].get(str(batch))), ratios[1],
                      f"{rss:.0f}" if rss else "—",
                      fmt_ratio(rss / eager_rss) if rss and eager_rss else "—"))
    print_table(("engine", "cold first token s", "warm first token s", "cold from process start s",
                 "warm from process start s", "decode b1 tok/s", "× frozen",
                 f"decode b{batch} tok/s", "× frozen", "peak RSS b1 MiB", "× HF RSS"), table)
    print(f"targets, from process start: cold ≤ {TARGETS['cold_s']:.0f} s, warm ≤ {TARGETS['warm_s']:.0f} s; decode ≥ "
          f"{TARGETS['decode_vs_frozen']}× the frozen build, peak RSS ≤ transformers eager's")


def print_depth_table(rows: list[dict]) -> None:
    print_table(("model", "cold compile s", "× default model"),
                [(row["label"], f"{row['compile_s']:.1f}" if row["compile_s"] else "—", fmt_ratio(row["vs_default"]))
                 for row in rows])
    print(f"target: each within {TARGETS['depth_ratio']}× the default model's")


def main(argv=None) -> None:
    args = parse_args(argv)
    path, model_name, _ = resolve_model(args.model)
    state = machine_state()
    print(f"model: {model_name} ({path}); prompt {args.prompt_tokens} tokens, {args.new_tokens} decode steps, "
          f"{args.runs} runs, {args.threads} threads")
    print_machine_state(state)
    vocab = read_hf_config(path)["vocab_size"]
    prompts = [prompt_ids(vocab, args.prompt_tokens, row) for row in range(args.batch)]
    results = {"model": str(path), "machine": state, "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="qrt-startup-") as work:
        runner = Runner(path, prompts, args, args.threads, Path(work))
        if not args.depth_only:
            results["start"] = start_rows(runner, args)
            print()
            print_start_table(results["start"], args.batch)
        if not args.no_depth:
            results["depth"] = depth_rows(runner, args, Path(work))
            print()
            print_depth_table(results["depth"])
    errors = [e for row in results.get("start", []) for e in row.get("errors", [])]
    errors += [f"{row['label']}: {row['job']['error']}" for row in results.get("depth", []) if "error" in row["job"]]
    for error in errors:
        print(f"ERROR {error}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
