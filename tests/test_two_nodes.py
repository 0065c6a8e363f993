"""Tensor parallelism over two nodes, as the README's multi-node command runs it: two torchrun
launchers, `--nnodes 2 --node-rank 0` and `--node-rank 1`, one process each, meeting through
torchrun's c10d rendezvous on 127.0.0.1 (two nodes on one machine: each launcher knows the
other only through the rendezvous endpoint). Together they run the tiny Llama at tp=2 in
float32, on gloo; its logits and greedy tokens must be those of one process."""

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from bench.tp import free_port
from helpers.compare import relative_l2
from test_tensor_parallel import IDS, SUMMATION_ORDER, job, single_rank

WORKER = Path(__file__).parent / "helpers" / "tp_worker.py"
TIMEOUT_S = 300  # both launchers end well within this, or the test fails
JOIN_TIMEOUT_S = 120  # a launcher whose peer never joins gives up by itself after this


def launcher(node_rank: int, endpoint: str, run_id: str, program: list[str], log) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
               "--rdzv-conf", f"join_timeout={JOIN_TIMEOUT_S}", "--local-addr", "127.0.0.1", *program]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QRT_DIST_TIMEOUT_S": str(TIMEOUT_S)}
    # A session of its own: on failure the whole launcher, its rank included, is killed at once.
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.slow  # about a minute on two cores: `make test-slow`
def test_two_torchrun_nodes_at_tp2_give_one_process_logits_and_tokens(llama_dir, tmp_path):
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([job("two nodes", llama_dir)]))
    program = [str(WORKER), str(jobs), str(tmp_path / "results.pt")]
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"qrt-two-nodes-{uuid.uuid4().hex[:8]}"
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    files = [log.open("w") for log in logs]
    nodes = [launcher(rank, endpoint, run_id, program, files[rank]) for rank in (0, 1)]
    try:
        codes = [node.wait(TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(10)
        for file in files:
            file.close()
    # The worker's own error comes before the launchers' tracebacks: keep enough to reach it.
    output = "\n".join(f"--- node {rank} ---\n{log.read_text()[-16000:]}" for rank, log in enumerate(logs))
    assert codes == [0, 0], output
    got = torch.load(tmp_path / "results.pt")["two nodes"]
    logits, tokens = single_rank(llama_dir)
    assert len(got["ranks"]) == 2 and got["logits"].shape == (len(IDS), len(IDS[0]), logits.shape[-1])
    assert relative_l2(got["logits"], logits) < SUMMATION_ORDER, output
    assert got["tokens"] == tokens
    # Both nodes computed the same logits, bit for bit (the tokens are rank 0's, broadcast).
    assert torch.equal(got["ranks"][0]["logits"], got["ranks"][1]["logits"])
