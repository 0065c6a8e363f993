"""Tensor parallelism: decode tokens/s and per-rank peak RSS of the 0.85B random Llama
(bench/tools/random_llama.py) at tp=1 and tp=2, in one run.

    python -m bench.tp                       # CPU: tp=1 on 2 threads, tp=2 on 1 thread per rank
    python -m bench.tp --device cuda --tp 1,2,4   # one GPU per rank (NCCL), on a multi-GPU machine

Each configuration runs under torchrun (also tp=1, so that all pay the same launcher), compiles
the regional build (qrt's compile cache on), then decodes `--steps` tokens greedily `--runs`
times after a fixed prompt. Decode tokens/s is the median over the runs of (tokens - 1) / (time
from the first token to the last), so prefill is not in it. Peak RSS is each rank's
`ru_maxrss` at the end. On a 2-core CPU two ranks share the cores that one rank had: the point
of tp=2 there is memory per rank and correctness, not speed.

Also times one all-reduce of a decode step's activations on each rank, the collective a step
makes twice per layer, by the path the model's all-reduces take (shared memory when every rank is
on this host's CPU, else gloo or NCCL; QRT_SHM_ALLREDUCE=0 forces the process group's), and says
which. Writes bench/results/tp.json (or --json) and prints a table.
"""

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "tp.json"
PROMPT = list(range(100, 164))  # 64 token ids


def worker(args) -> None:
    """One rank: build, decode, report (rank 0 writes the JSON line to args.out)."""
    import torch
    import torch.distributed as dist

    from qrt import runtime

    torch.set_num_threads(args.threads)
    model = runtime.compile_model(args.path, tp=args.tp, device=args.device, max_seq_len=512, progress=False)
    all_reduce_us = time_all_reduce(model) if dist.is_initialized() else None
    rates = []
    for _ in range(args.runs):
        stamps = []
        model.generate(PROMPT, max_new_tokens=args.steps, stop_at_eos=False,
                       stream=lambda _token: stamps.append(time.perf_counter()))
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    mine = {"rank": model.parallel.rank, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "decode_tok_s": statistics.median(rates), "runs_tok_s": rates, "all_reduce_us": all_reduce_us,
            "all_reduce_path": model.parallel.all_reduce_path if dist.is_initialized() else None,
            "collectives_per_step": 2 * model.model.config.num_layers + 2}
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if model.parallel.rank == 0:
        Path(args.out).write_text(json.dumps({"tp": args.tp, "threads_per_rank": args.threads, "ranks": ranks}))


def time_all_reduce(model, calls: int = 200) -> float:
    """Median µs of one all-reduce of a decode step's activations ([1, 1, hidden] in the model
    dtype), the collective a decode step makes twice per layer (once more for the embedding;
    the logits' all-gather is the step's last). It goes the way the model's all-reduces go
    (qrt.layers.tensor_parallel.all_reduce: shared memory or the group's backend), and is waited for."""
    import torch
    import torch.distributed._functional_collectives as collectives

    from qrt.layers.tensor_parallel import all_reduce

    # [1, 1, hidden]: never zeros, so that the sum is real work on every path
    x = torch.ones(1, 1, model.model.config.hidden_size, dtype=model.model.dtype, device=model.device)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        collectives.wait_tensor(all_reduce(x, model.parallel))
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_localhost(nproc: int, program: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC PROGRAM…` on a free port of 127.0.0.1, output captured.

    It runs in a session of its own, so that past `timeout` the ranks are stopped with torchrun
    (killing torchrun alone leaves them running); then subprocess.TimeoutExpired is raised."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *program]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_config(path: Path, tp: int, threads: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        program = ["-m", "bench.tp", "--worker", "--path", str(path), "--tp", str(tp), "--threads", str(threads),
                   "--device", args.device, "--steps", str(args.steps), "--runs", str(args.runs), "--out", str(out)]
        try:
            done = torchrun_localhost(tp, program, {**os.environ, "OMP_NUM_THREADS": str(threads)}, args.timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"tp={tp}: no result within {args.timeout} s; stopped") from None
        if done.returncode != 0:
            raise SystemExit(f"tp={tp} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2", help="comma-separated tp values (default: 1,2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="CPU threads in all, divided between the ranks (default: every core)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    parser.add_argument("--path", default=None, help="checkpoint (default: the 0.85B random Llama)")
    parser.add_argument("--json", default=str(RESULTS), help=f"where to write the results (default: {RESULTS})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.tp = int(args.tp)
        worker(args)
        return 0
    if args.path is None:
        from bench.tools.random_llama import random_llama_path

        args.path = random_llama_path()
    rows = []
    for tp in (int(t) for t in args.tp.split(",")):
        threads = max(1, args.cores // tp) if args.device == "cpu" else 1
        result = run_config(Path(args.path), tp, threads, args)
        rows.append(result)
        for rank in result["ranks"]:
            print(f"tp={tp} rank {rank['rank']}: {threads} thread(s), decode {rank['decode_tok_s']:.1f} tok/s "
                  f"(runs {', '.join(f'{r:.1f}' for r in rank['runs_tok_s'])}), peak RSS {rank['peak_rss_mib']:.0f} MiB",
                  flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checkpoint": str(args.path), "device": args.device, "steps": args.steps,
                                   "runs": args.runs, "results": rows}, indent=2))
    print(f"\n| tp | threads per rank | decode tok/s (median of {args.runs}) | peak RSS per rank (MiB) "
          f"| one all-reduce (µs) | all-reduce path | all-reduces per step |")
    print("|---|---|---|---|---|---|---|")
    for result in rows:
        rss = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in result["ranks"])
        first = result["ranks"][0]
        reduce = "—" if first["all_reduce_us"] is None else f"{first['all_reduce_us']:.1f}"
        path = first["all_reduce_path"] or "—"
        steps = "—" if first["all_reduce_us"] is None else str(first["collectives_per_step"] - 1)
        print(f"| {result['tp']} | {result['threads_per_rank']} | {first['decode_tok_s']:.1f} | {rss} | {reduce} "
              f"| {path} | {steps} |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
