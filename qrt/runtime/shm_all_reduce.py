"""Whether a tensor-parallel group's all-reduces go through shared memory, and the segment they use.

When every rank of a CPU group runs on this host, an all-reduce needs no network: each rank
copies its part into a segment all of them map, and sums everyone's parts itself
(qrt_cpu::shm_all_reduce, qrt/kernels/csrc/shm_all_reduce_cpu.cpp). gloo would send a decode
step's few KiB through sockets and its own threads, which costs far more than the sum. The choice
is made once per process group, when the model's Parallelism is made; elsewhere (GPUs, ranks on
several hosts, no native CPU kernels, QRT_SHM_ALLREDUCE=0) the group's own backend reduces.
"""

import os
import secrets
import socket
import warnings

import torch
import torch.distributed as dist

from qrt.kernels import native_cpu

# Bytes of one rank's slot (there are two per rank, by call parity): a decode step's activation
# fits many times over; a larger tensor (a long prefill's) goes through in slot-sized chunks.
SLOT_BYTES = 1 << 20

_handles: dict = {}  # process group -> its segment's handle, or None where it reduces otherwise


def shm_all_reduce_handle(group, rank: int, world_size: int, device: torch.device, timeout_s: float) -> int | None:
    """The handle of the group's shared-memory segment, mapped by every rank, or None when its
    all-reduces go through its backend. Called by every rank of `group` at the same point (on a
    CPU it exchanges hostnames, and the segment's name, over the group); once per group."""
    if group not in _handles:
        # The switch and the device are the same on every rank (one command starts them all), so
        # they are decided without asking the others.
        switched_off = os.environ.get("QRT_SHM_ALLREDUCE", "1") == "0" or device.type != "cpu"
        _handles[group] = None if switched_off else _open_if_every_rank_can(group, rank, world_size, timeout_s)
    return _handles[group]


def _open_if_every_rank_can(group, rank: int, world_size: int, timeout_s: float) -> int | None:
    ranks = [None] * world_size
    dist.all_gather_object(ranks, (socket.gethostname(), native_cpu.available()), group=group)
    if len({host for host, _ in ranks}) > 1 or not all(kernels for _, kernels in ranks):
        return None
    # Rank 0 creates the segment under a name of its own making and sends it (or why it could
    # not) to the others; once every rank has mapped it, the name goes, so nothing outlives them.
    offer, handle = [None, None], None
    if rank == 0:
        name = f"/qrt-all-reduce-{os.getpid()}-{secrets.token_hex(6)}"
        handle, failure = _open(name, rank, world_size, True, timeout_s)
        offer = [name, failure]
    dist.broadcast_object_list(offer, src=0, group=group)
    name, creation_failure = offer
    failure = creation_failure if rank == 0 else None
    if rank != 0 and creation_failure is None:
        handle, failure = _open(name, rank, world_size, False, timeout_s)
    failures = [None] * world_size
    dist.all_gather_object(failures, failure, group=group)  # every rank has mapped it, or failed to
    if rank == 0 and creation_failure is None:
        torch.ops.qrt_cpu.shm_all_reduce_unlink(name)
    failed = [f"rank {r}: {why}" for r, why in enumerate(failures) if why is not None]
    if failed:
        warnings.warn(f"all-reduces go through {dist.get_backend(group)}, not shared memory: {'; '.join(failed)}",
                      stacklevel=3)
        return None
    return handle


def _open(name: str, rank: int, world_size: int, create: bool, timeout_s: float) -> tuple[int | None, str | None]:
    """The segment's handle in this process, or why it could not be mapped."""
    try:
        return torch.ops.qrt_cpu.shm_all_reduce_open(name, rank, world_size, SLOT_BYTES, create, timeout_s), None
    except RuntimeError as error:
        return None, str(error).splitlines()[0]
