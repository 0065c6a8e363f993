"""The process group a tensor-parallel model runs in: torch.distributed, started the way torchrun's
environment describes (NCCL on GPUs, gloo on CPUs), so multi-node runs use torchrun's rendezvous
and qrt has no launcher of its own. CPU ranks that all run on one host reduce through shared
memory instead of gloo (runtime/shm_all_reduce.py)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from qrt.errors import ConfigError
from qrt.layers.tensor_parallel import SINGLE, Parallelism
from qrt.runtime.shm_all_reduce import shm_all_reduce_handle

# How long a collective may wait for the other ranks before it fails (and the process exits):
# a rank that died never answers, and nothing may hang forever. $QRT_DIST_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 600
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("QRT_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


def tensor_parallel(tp: int, device: torch.device) -> Parallelism:
    """The Parallelism of `tp` ranks for this process, starting its process group if none is.

    Every rank of the group is one rank of the model: tp must equal the world size."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp={tp!r}; expected a positive integer (the number of ranks to shard the model over)")
    if tp == 1 and not dist.is_initialized():
        return SINGLE
    if not dist.is_initialized():
        missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise ConfigError(
                f"tp={tp} runs one process per rank, and this process was not started as one (no {', '.join(missing)} "
                f"in its environment). Start the ranks with torchrun, for example:\n"
                f"  torchrun --nproc-per-node {tp} -m qrt generate PATH --tp {tp}\n"
                f"or call compile_model(..., tp={tp}) in every process torchrun starts")
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout())
    world = dist.get_world_size()
    if world != tp:
        raise ConfigError(f"tp={tp}, but the process group has {world} ranks; qrt shards a model over every rank of "
                          f"the group, so start {tp} processes (torchrun --nproc-per-node {tp} …) or pass tp={world}")
    if tp == 1:
        return SINGLE
    group, rank = dist.group.WORLD, dist.get_rank()
    return Parallelism(tp, rank, group, shm_all_reduce_handle(group, rank, tp, device, timeout().total_seconds()))


def rank_device(device: torch.device, parallel: Parallelism) -> torch.device:
    """The device of this rank: its own GPU (LOCAL_RANK, as torchrun numbers them) on CUDA."""
    if device.type == "cuda" and parallel.sharded and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def broadcast_from_first(tokens: torch.Tensor, parallel: Parallelism) -> torch.Tensor:
    """Rank 0's `tokens` on every rank: rank 0 samples, so that all ranks decode the same tokens
    even where their logits differ in the last bit or sampling draws differ."""
    if parallel.sharded:
        dist.broadcast(tokens, src=0, group=parallel.group)
    return tokens


def leave_process_group() -> None:
    """Close the process group this process started (torch warns at exit otherwise)."""
    if dist.is_initialized():
        dist.destroy_process_group()
