"""One measurement of one engine, in a process of its own (bench/suite.py starts one per job):

    python -m bench.engines JOB.json RESULT.json

A fresh process keeps one engine's memory, threads, compiled graphs and in-memory caches out of the
next one's figures, and makes its peak resident memory its own: VmHWM, the high-water mark of the
process's resident set since it started this script, imports included. (Not ru_maxrss: Linux carries
that over from the parent through fork and exec, so every job would report at least the suite's
own peak.) The job names the
engine ("kind"), the checkpoint, the prompts (one per batch row, of equal length), the number of new
tokens N, of timed runs and of threads. Every engine decodes greedily and never stops at eos.

Kinds and what their figures mean:
- qrt-start: `compile_model(path, quant, warmup=False)` (load_s), then `warmup()`, which compiles
  prefill and decode or loads them from qrt's compile cache (compile_s), then the first token of
  the prompt (first_token_s: load, compile and that generate, from the call of compile_model;
  process_first_token_s: the same token from the process's start, Python and every import
  included, which is what a user waits for). Run
  with an empty QRT_CACHE_DIR (and TORCHINDUCTOR_CACHE_DIR unset, so that Inductor's caches live
  there too) it is a cold start; run again with the same folder, a warm one. The job may name the
  build ("regional" or "frozen") and load_format "dummy" (random weights: compile time only).
- qrt: a qrt-start at batch 1, then its speed; at batch B > 1 `compile_model(..., max_batch_size=B)`
  and `generate_batch`, and compile_s is its first call, generating 2 tokens (it compiles prefill
  and decode for that batch size, and runs one prefill and one decode step).
- transformers: `from_pretrained(dtype=bf16)` (load_s), eager. transformers-compile: the same with
  a static KV cache and `torch.compile(model.forward)` (mode "default"); compile_s is its first
  generate of 2 tokens (the compiles, one prefill, one decode step).
- llama.cpp: llama-cpp-python's `Llama` on a GGUF file (load_s), batch 1 only: its high-level API
  runs one sequence. Timed as the bare step: `Llama.eval` of the prompt and then of each new token,
  the argmax read from the context's logits (not `generate()`, whose sampler chain and loop add
  their own time to every token). It never imports torch, so its peak memory is llama.cpp's.
Speeds: prefill = generate 1 token; decode = the tokens of a generate of N + 1 made after every
sequence had its first, over the time from then to the last token, as the engine streams them
out (see bench/measure.decode_rate), each the spread of the job's runs after one untimed run.
"""

import json
import sys
import time
from pathlib import Path

from bench.measure import (TokenClock, TransformersClock, check_length, log, process_age, speeds,
                           timed_decodes, timed_runs, wall_time)


def cache_length(job: dict) -> int:
    """KV cache positions every engine gets: the prompt, N decode steps and the last sampled token,
    or the job's own `cache_length` (bench/context.py gives every prompt length the same cache, so
    that one compiled graph serves them all)."""
    return job.get("cache_length") or len(job["prompts"][0]) + job["new_tokens"] + 1


def time_speeds(run, job: dict) -> dict:
    """Prefill and decode figures of run(n), which generates n new tokens for every prompt and
    returns each prompt's token times (measure.decode_rate): the prefill from run(1)'s wall time,
    the decode timed from the first new token to the last of run(new_tokens + 1)."""
    new_tokens, prompts = job["new_tokens"], job["prompts"]
    return speeds(timed_runs(lambda: run(1), job["runs"]), timed_decodes(lambda: run(new_tokens + 1), job["runs"]),
                  len(prompts[0]), len(prompts))


def check_rows(rows, job: dict, expected: int, engine: str) -> None:
    check_length(rows, len(job["prompts"]), f"{engine} (rows)")
    for row in rows:
        check_length(row, expected, engine)


def load_qrt(job: dict):
    import torch

    from bench.roofline import expert_weight_bytes, resident_weight_bytes, weight_bytes_per_token
    from qrt.checkpoint.config import LoadConfig
    from qrt.runtime import compile_model

    torch.set_num_threads(job["threads"])
    log(f"{job['label']}: loading")
    started = time.perf_counter()
    model = compile_model(job["path"], job["quant"], max_seq_len=cache_length(job),
                          max_batch_size=len(job["prompts"]), warmup=False, progress=False, build=job.get("build"),
                          load_config=LoadConfig(load_format=job.get("load_format", "auto"), progress=False))
    load_s = time.perf_counter() - started
    # Every timed run repeats the prompt: with prefix caching a run would skip the chunks the one
    # before left in its slot, and prefill would time only the remainder.
    model.engine.prefix_caching = False
    causal_lm = model.model
    return model, started, {"load_s": load_s, "expert_bytes": expert_weight_bytes(causal_lm),
                            "resident_weight_bytes": resident_weight_bytes(causal_lm),
                            "weight_bytes_per_token": weight_bytes_per_token(causal_lm,
                                                                             getattr(causal_lm.model.embed_tokens, "weight", None))}


def warm_up(model, job: dict, started: float) -> dict:
    """Compile (or load the compiled graphs), then generate the first token of the prompt."""
    log(f"{job['label']}: compiling")
    compile_s = wall_time(model.warmup)
    check_length(model.generate(job["prompts"][0], max_new_tokens=1, stop_at_eos=False), 1, job["label"])
    return {"compile_s": compile_s, "compile_seconds": dict(model.compile_seconds),
            "first_token_s": time.perf_counter() - started, "process_first_token_s": process_age(),
            "cache_hit": model.cache_hit}


def qrt_start(job: dict) -> dict:
    model, started, figures = load_qrt(job)
    return {**figures, **warm_up(model, job, started)}


def qrt(job: dict) -> dict:
    engine, prompts = job["label"], job["prompts"]
    model, started, figures = load_qrt(job)
    if len(prompts) == 1:
        figures.update(warm_up(model, job, started))

        def run(n: int) -> list[list[float]]:
            clock = TokenClock()
            check_length(model.generate(prompts[0], max_new_tokens=n, stop_at_eos=False, stream=clock.tick), n, engine)
            return clock.rows()
    else:
        def run(n: int) -> list[list[float]]:
            clocks = [TokenClock() for _ in prompts]
            rows = model.generate_batch(prompts, n, stop_at_eos=False, stream=lambda row, _: clocks[row].tick())
            check_rows(rows, job, n, engine)
            return [clock.stamps for clock in clocks]

        log(f"{engine}: compiling for batch {len(prompts)}")
        figures["compile_s"] = wall_time(lambda: run(2))
    log(f"{engine}: timing")
    figures.update(time_speeds(run, job))
    # 1 graph per role: nothing was recompiled while timing.
    figures["graphs"] = model.compile_report()
    return figures


def transformers_engine(job: dict, compiled: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.roofline import expert_weight_bytes, weight_bytes_per_token

    torch.set_num_threads(job["threads"])
    engine = job["label"]
    log(f"{engine}: loading")
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["path"], dtype=torch.bfloat16)
    figures = {"load_s": time.perf_counter() - started, "expert_bytes": expert_weight_bytes(model),
               "weight_bytes_per_token": weight_bytes_per_token(model, model.get_input_embeddings().weight)}
    if compiled:
        # A static cache keeps the KV tensors' shapes fixed as the sequence grows, so the compiled
        # forward is not traced again each step; one max_cache_len for every generate call keeps
        # the prefill-only runs from sizing it differently.
        model.generation_config.cache_implementation = "static"
        model.generation_config.max_cache_len = cache_length(job)
        model.forward = torch.compile(model.forward, mode="default")
    input_ids = torch.tensor(job["prompts"])
    attention_mask = torch.ones_like(input_ids)

    def run(n: int) -> list[list[float]]:
        # min_new_tokens keeps eos from ending generation early.
        clock = TransformersClock()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, streamer=clock)
        check_rows(out[:, input_ids.shape[1]:].tolist(), job, n, engine)
        return clock.rows(len(job["prompts"]))

    if compiled:
        log(f"{engine}: compiling")
        figures["compile_s"] = wall_time(lambda: run(2))
    log(f"{engine}: timing")
    figures.update(time_speeds(run, job))
    return figures


def llama_cpp(job: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama

    (prompt,) = job["prompts"]
    log(f"{job['label']}: loading")
    started = time.perf_counter()
    llm = Llama(model_path=job["gguf"], n_ctx=cache_length(job), n_batch=len(prompt), n_threads=job["threads"],
                n_threads_batch=job["threads"], verbose=False)
    figures = {"load_s": time.perf_counter() - started}
    vocab = llm.n_vocab()

    def next_token() -> int:
        """The argmax of the last evaluated token's logits, read in place from llama.cpp's buffer."""
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())

    def run(n: int) -> list[list[float]]:
        # The bare step: Llama.eval of the prompt, then of each new token, the argmax read from the
        # context's logits. llama-cpp-python's generate() runs its sampler chain and Python loop
        # around every step, which cost about a third of a Q4_1 step of the default model; qrt's
        # own figures include only its greedy argmax, so the peer is timed the same way.
        llm.reset()
        clock = TokenClock()
        llm.eval(prompt)
        new_ids = [next_token()]
        clock.tick()
        while len(new_ids) < n:
            llm.eval(new_ids[-1:])
            new_ids.append(next_token())
            clock.tick()
        check_length(new_ids, n, job["label"])
        return clock.rows()

    log(f"{job['label']}: timing")
    figures.update(time_speeds(run, job))
    return figures


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status: peak memory is measured on Linux only")


KINDS = {
    "qrt-start": qrt_start,
    "qrt": qrt,
    "transformers": lambda job: transformers_engine(job, compiled=False),
    "transformers-compile": lambda job: transformers_engine(job, compiled=True),
    "llama.cpp": llama_cpp,
}


def main() -> None:
    job_path, result_path = map(Path, sys.argv[1:3])
    job = json.loads(job_path.read_text())
    try:
        figures = KINDS[job["kind"]](job)
    except Exception as error:
        # The suite records what failed and goes on with the next job; the traceback goes to stderr.
        result_path.write_text(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        raise
    figures["peak_rss_mib"] = peak_rss_mib()
    result_path.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
