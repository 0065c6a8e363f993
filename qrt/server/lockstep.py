"""`qrt serve` over a sharded model (`torchrun --nproc-per-node N -m qrt serve … --tp N`): rank 0
serves HTTP and runs the engine; every other rank runs the same engine over its shard of the
weights, stepping in lockstep with rank 0.

Before each step rank 0 sends a Round (the requests that arrived, the requests to drop) over a
gloo group of the ranks' own; then all ranks step, and the step's collectives are the model's
own (its all-reduces, and rank 0's sampled tokens). Every rank's engine then holds the same
requests in the same slots. While idle, rank 0 sends an empty round every HEARTBEAT_S, so that
no rank's wait reaches the process group's timeout, and at shutdown a last round that ends them.
"""

import signal
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from qrt.runtime.engine import Engine, Request, Sequence

HEARTBEAT_S = 5.0


@dataclass
class Round:
    added: list[tuple[int, Request]] = field(default_factory=list)  # (number, request), in arrival order
    dropped: list[int] = field(default_factory=list)  # the numbers of requests to drop at this step
    step: bool = False
    last: bool = False


def ranks_group():
    """A gloo group of every rank, for the rounds: created by all ranks at the same point, after
    the model has loaded."""
    return dist.new_group(backend="gloo")


def _exchange(group, round_: Round | None) -> Round:
    box = [round_]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Leader:
    """Rank 0's side: numbers the requests it hands the engine and sends each round."""

    def __init__(self):
        self.group = ranks_group()
        self.numbers: dict[int, int] = {}  # id(sequence) -> its number, for the requests in hand
        self._next = 0
        self.sent_at = time.monotonic()

    def send(self, engine: Engine, added: list[Sequence], last: bool = False) -> list[Sequence]:
        """Send this round (the requests just added; those marked cancelled now) and return the
        ones to drop at this step."""
        for seq in added:
            self.numbers[id(seq)] = self._next
            self._next += 1
        dropped = [seq for seq in engine.live() if seq.cancelled]
        round_ = Round([(self.numbers[id(seq)], seq.request) for seq in added],
                       [self.numbers[id(seq)] for seq in dropped], step=engine.has_work, last=last)
        _exchange(self.group, round_)
        self.sent_at = time.monotonic()
        # Only the requests still in hand can be dropped later: forget the rest (and their ids,
        # which Python may give to new objects).
        kept = {id(seq) for seq in engine.live()} - {id(seq) for seq in dropped}
        self.numbers = {key: number for key, number in self.numbers.items() if key in kept}
        return dropped

    def heartbeat_due(self) -> bool:
        return time.monotonic() - self.sent_at > HEARTBEAT_S


def follow(model, *, chunk_size: int, prefix_caching: bool) -> int:
    """A rank other than 0: run the engine as rank 0's rounds say, until the last round. SIGTERM
    and SIGINT (torchrun passes them to every rank) are left to rank 0, which drains its requests
    first and then ends this rank with its last round."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    group = ranks_group()
    engine = Engine(model, chunk_size=chunk_size, prefix_caching=prefix_caching)
    sequences: dict[int, Sequence] = {}
    while True:
        round_ = _exchange(group, None)
        if round_.last:
            return 0
        for number, request in round_.added:
            sequences[number] = engine.submit(request)
        dropped = [sequences.pop(number) for number in round_.dropped if number in sequences]
        if round_.step:
            engine.step(cancelled=dropped)
        for number in [n for n, seq in sequences.items() if seq.done]:
            del sequences[number]
