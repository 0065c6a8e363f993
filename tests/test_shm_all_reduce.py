"""The shared-memory all-reduce of tensor-parallel CPU ranks on one host (qrt_cpu::shm_all_reduce,
qrt/runtime/shm_all_reduce.py): two and three ranks under torchrun sum random bf16 and fp32
tensors of every size (one value to several slots, and hundreds of calls in a row) to exactly the
fp32 sum in rank order, identical on every rank; a compiled function that calls all_reduce is one
graph with the op in it; QRT_SHM_ALLREDUCE=0 goes through gloo. In one process: a rank that never
arrives makes the wait fail, naming it, and a segment's name is gone once unlinked."""

import os
from pathlib import Path

import pytest
import torch
from bench.tp import torchrun_localhost

from qrt.kernels import native_cpu

pytestmark = pytest.mark.skipif(native_cpu.why_not_wanted() is not None, reason=f"{native_cpu.why_not_wanted()}")

WORKER = Path(__file__).parent / "helpers" / "shm_all_reduce_worker.py"
TIMEOUT_S = 300  # every run below ends well within this, or the test fails


@pytest.fixture(autouse=True)
def kernels():
    """The ops are qrt's CPU kernels: built and loaded, or the build's failure is the test's."""
    assert native_cpu.why_unavailable() is None


def run_ranks(world_size: int, folder: Path, *flags: str, env=None) -> list[dict]:
    results = folder / "results.pt"
    done = torchrun_localhost(world_size, [str(WORKER), str(results), *flags],
                              {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(results)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_gets_the_fp32_sum_in_rank_order(world_size, tmp_path):
    ranks = run_ranks(world_size, tmp_path)
    assert [rank["path"] for rank in ranks] == ["shm"] * world_size
    for number, rank in enumerate(ranks):
        assert rank["mismatches"] == [], (number, rank["mismatches"][:5])
    assert len({rank["digest"] for rank in ranks}) == 1, "the ranks' sums differ"


def test_a_compiled_all_reduce_is_one_graph_with_the_op_in_it(tmp_path):
    ranks = run_ranks(2, tmp_path, "--compile")
    for rank in ranks:
        assert rank["path"] == "shm"
        assert (rank["graph_breaks"], rank["graphs"]) == (0, 1)
        assert any(op.startswith("qrt_cpu.shm_all_reduce") for op in rank["ops"]), rank["ops"]
        assert rank["compiled_matches"]


def test_switched_off_the_all_reduce_goes_through_gloo(tmp_path):
    # gloo adds bf16 in bf16; two randn draws add exactly in fp32, so the sums match here too.
    ranks = run_ranks(2, tmp_path, env={"QRT_SHM_ALLREDUCE": "0"})
    assert [rank["path"] for rank in ranks] == ["gloo", "gloo"]
    assert len({rank["digest"] for rank in ranks}) == 1


def test_a_rank_that_never_arrives_is_named_when_the_wait_times_out():
    name = f"/qrt-test-{os.getpid()}"
    handle = torch.ops.qrt_cpu.shm_all_reduce_open(name, 0, 2, 4096, True, 0.3)
    torch.ops.qrt_cpu.shm_all_reduce_unlink(name)
    with pytest.raises(RuntimeError, match=r"rank 0 waited 0.3 s for rank 1 to reach all-reduce call 1"):
        torch.ops.qrt_cpu.shm_all_reduce(torch.ones(8), handle)
    assert not Path("/dev/shm", name[1:]).exists()
    with pytest.raises(RuntimeError, match=r"shm_open\(" + name):
        torch.ops.qrt_cpu.shm_all_reduce_open(name, 1, 2, 4096, False, 0.3)


def test_one_rank_sums_its_own_tensor_whatever_its_layout():
    name = f"/qrt-test-one-{os.getpid()}"
    handle = torch.ops.qrt_cpu.shm_all_reduce_open(name, 0, 1, 4096, True, 1.0)
    torch.ops.qrt_cpu.shm_all_reduce_unlink(name)
    x = torch.randn(40, 30).t()  # not contiguous, and more than one 4096-byte slot
    assert torch.equal(torch.ops.qrt_cpu.shm_all_reduce(x, handle), x)
    with pytest.raises(RuntimeError, match="a bf16 or fp32 CPU tensor expected"):
        torch.ops.qrt_cpu.shm_all_reduce(x.half(), handle)
