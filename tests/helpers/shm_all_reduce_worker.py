"""One rank of the shared-memory all-reduce test (tests/test_shm_all_reduce.py), started by torchrun.

    torchrun --nproc-per-node N tests/helpers/shm_all_reduce_worker.py RESULTS.pt [--compile]

Every rank builds its Parallelism as a model would (qrt.runtime.distributed.tensor_parallel), then
sums, through qrt.layers.tensor_parallel.all_reduce, random tensors of each case (dtype, shape):
rank r's input of call c is drawn from seed (r, c), so every rank can make every rank's input and
the sum it expects, added in fp32 in rank order and rounded once. Rank 0 saves each rank's path
("shm" or the backend), its mismatches and a digest of its results, and with --compile the graph
breaks and graph count of a compiled function that calls all_reduce.
"""

import hashlib
import sys

import torch
import torch.distributed as dist

from qrt.layers.tensor_parallel import all_reduce
from qrt.runtime.distributed import tensor_parallel
from qrt.runtime.shm_all_reduce import SLOT_BYTES

FP32_PER_SLOT = SLOT_BYTES // 4
# (dtype, shape): one value, a tail shorter than a vector, a decode step's activation, a prefill's
# rows, one bf16 slot exactly (two fp32 slots), and two slots and a few values more.
CASES = [(dtype, shape) for dtype in (torch.bfloat16, torch.float32)
         for shape in ((1,), (1, 1, 17), (1, 1, 2048), (7, 2048), (2 * FP32_PER_SLOT,), (2 * FP32_PER_SLOT + 5,))]
REPEATS = 300  # small calls in a row: the two sets of slots are reused many times over


def rank_input(rank: int, call: int, dtype, shape) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    values = torch.randn(shape, generator=generator) + 0.5  # never zeros: a missing part shows
    return values.to(dtype)


def expected_sum(world_size: int, call: int, dtype, shape) -> torch.Tensor:
    total = rank_input(0, call, dtype, shape).float()
    for rank in range(1, world_size):
        total = total + rank_input(rank, call, dtype, shape).float()
    return total.to(dtype)


def main() -> None:
    results_path, compile_too = sys.argv[1], "--compile" in sys.argv
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    parallel = tensor_parallel(world_size, torch.device("cpu"))
    calls = list(CASES) + [(torch.bfloat16, (1, 1, 64))] * REPEATS
    mismatches, digest = [], hashlib.sha256()
    for call, (dtype, shape) in enumerate(calls):
        got = all_reduce(rank_input(rank, call, dtype, shape), parallel)
        if not torch.equal(got, expected_sum(world_size, call, dtype, shape)):
            mismatches.append(f"call {call}: {dtype} {shape}")
        digest.update(got.view(torch.uint8).numpy().tobytes() if got.numel() else b"")
    mine = {"path": parallel.all_reduce_path, "mismatches": mismatches, "digest": digest.hexdigest()}
    if compile_too:
        mine.update(compiled(parallel, rank, world_size))
    ranks = [None] * world_size
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        torch.save(ranks, results_path)
    dist.destroy_process_group()


def compiled(parallel, rank: int, world_size: int) -> dict:
    """A function around all_reduce, compiled whole by Inductor: its graph breaks and graphs, and
    whether its result is the expected sum."""
    def step(x):
        return all_reduce(x * 2, parallel) + 1

    x = rank_input(rank, -1, torch.bfloat16, (1, 1, 256))
    explained = torch._dynamo.explain(step)(x)
    got = torch.compile(step, fullgraph=True)(x)
    halves = [rank_input(r, -1, torch.bfloat16, (1, 1, 256)) * 2 for r in range(world_size)]
    expected = (sum((h.float() for h in halves[1:]), halves[0].float()).to(torch.bfloat16) + 1)
    return {"graph_breaks": explained.graph_break_count, "graphs": explained.graph_count,
            "ops": [str(node.target) for graph in explained.graphs for node in graph.graph.nodes
                    if node.op == "call_function"],
            "compiled_matches": torch.equal(got, expected)}


if __name__ == "__main__":
    main()
