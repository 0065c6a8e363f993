"""One rank of a tensor-parallel test run, started by torchrun (tests/test_tensor_parallel.py,
tests/test_producers.py).

    torchrun --nproc-per-node 2 tests/helpers/tp_worker.py JOBS.json RESULTS.pt
    python tests/helpers/tp_worker.py JOBS.json RESULTS.pt     # tp=1, one process

JOBS.json lists models to build with tp = the world size: {"name", "path", "quant", "compile",
"ids" (a [B, T] list), "prompt" (ids), "steps", optionally "tp", "dtype", "lora" ({name: adapter folder}: LoRA
adapters to load) with "use_lora" (the one the teacher-forced logits and the decoded tokens run with), "may_refuse" (true: an UnsupportedError
while loading is saved as "refused" instead of ending the run), "forward" (false: skip
the full forward), "again_prompt" (what a compiled model decodes again; default: the prompt less
its last token) and "teacher_forced" ({"ids": a list, "prefill": P}: the logits of
teacher_forced_logits, saved as "teacher_forced")}. With $QRT_TP_TEST_BAD_RANK_PATH,
rank 1 loads that checkpoint instead (the fault test). For each, every rank computes the logits of
"ids" and greedy-decodes "steps" tokens after "prompt"; rank 0 saves, per name, the logits, the
tokens, every rank's own logits, the compile report, every rank's RSS before the job's model and its peak RSS after loading
it, every rank's parameter shapes and the path its all-reduces took ("shm", "gloo").
"""

import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from qrt import runtime
from qrt.errors import UnsupportedError

# Run by path, this script has its own folder on sys.path; the helpers package is found from tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.graph_checks import no_recompiles  # noqa: E402


def run(job: dict) -> dict:
    path = job["path"]
    if os.environ.get("RANK") == "1" and os.environ.get("QRT_TP_TEST_BAD_RANK_PATH"):
        path = os.environ["QRT_TP_TEST_BAD_RANK_PATH"]  # the fault test: this rank alone gets a bad checkpoint
    rss_before_kib = current_rss_kib()
    try:
        model = runtime.compile_model(path, job.get("quant"), tp=job.get("tp", int(os.environ.get("WORLD_SIZE", 1))),
                                      dtype=job.get("dtype"), compile=job["compile"], cache=False, progress=False,
                                      warmup=False, max_seq_len=job.get("max_seq_len", 128), lora=job.get("lora"))
    except UnsupportedError as error:
        if not job.get("may_refuse"):
            raise
        # Every rank refuses alike (the same shapes), before any collective: the run goes on.
        return {"refused": str(error)}
    # No warm-up: a graph compiles when a role first runs, so a job compiles only the roles it runs.
    peak_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    logits = None
    if job.get("forward", True):  # the full forward (a third graph when compiled)
        with torch.no_grad():
            logits = model(torch.tensor(job["ids"]))
    forced = job.get("teacher_forced")
    adapter = job.get("use_lora")
    if forced:
        if adapter is not None:  # teacher_forced_logits drives cache slot 0 directly
            model.lora.bind(0, model.lora.residents[adapter])
        forced = teacher_forced_logits(model, forced["ids"], forced["prefill"])
        if adapter is not None:
            model.lora.bind(0, None)
    tokens = model.generate(job["prompt"], max_new_tokens=job["steps"], stop_at_eos=False, lora=adapter)
    if job["compile"]:  # decoding again, at other lengths, must not recompile on any rank
        with no_recompiles(model):
            again = model.generate(job.get("again_prompt", job["prompt"][:-1]), max_new_tokens=job["steps"],
                                   stop_at_eos=False, lora=adapter)
    else:
        again = None
    shapes = {name: list(p.shape) for name, p in model.model.named_parameters()}
    mine = {"logits": logits, "teacher_forced": forced, "rss_kib": peak_rss_kib, "rss_before_kib": rss_before_kib, "shapes": shapes, "tokens": tokens,
            "report": model.compile_report(),
            "all_reduce_path": model.parallel.all_reduce_path if model.parallel.sharded else None}
    gathered = [mine]
    if dist.is_initialized():  # tp=1 starts no process group
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    return {"refused": None, "logits": logits, "teacher_forced": forced, "tokens": tokens, "again": again,
            "ranks": gathered}


def teacher_forced_logits(model, ids: list[int], prefill: int) -> torch.Tensor:
    """The logits a user's generation computes, at every position of `ids` from prefill - 1 on:
    the first `prefill` tokens as one prompt chunk into cache slot 0, then each later token fed as
    a decode step (the KV cache holds all before it). float32 [len(ids) - prefill + 1, V]."""
    rows = [model.prefill_chunk(ids[:prefill], 0, 0)]
    for position in range(prefill, len(ids)):
        tokens, positions = model.idle_decode_rows()
        tokens[0], positions[0] = ids[position], position
        rows.append(model.decode_step(tokens, positions, position + 1)[0])
    return torch.stack(rows)


def current_rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> int:
    jobs_path, results_path = sys.argv[1], sys.argv[2]
    jobs = json.loads(open(jobs_path).read())
    torch.set_num_threads(1)
    results = {job["name"]: run(job) for job in jobs}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, results_path)
    if dist.is_initialized():
        # Every rank done before any leaves: a rank that exits while another still talks to the group
        # (or to the launcher's store, which goes with the first launcher to finish) can take it down.
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
