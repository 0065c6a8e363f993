"""Guesses from the checkpoint's own multi-token-prediction layer (speculative method "mtp";
models/mtp.py, DeepSeek-V3's): the layer reads the model's final hidden state at a position and
the token after it, and predicts the token after that.

The model's step graphs return their final hidden states (GraphRunner.step_hidden); each request
keeps those of the positions the layer has not been fed (GuessState.hidden). A prompt chunk feeds
the layer every pair whose next token the chunk holds; the chunk's last hidden state waits for the
token sampled after it. At a step that guesses, each request first catches its slot up: the pairs
of the tokens its last step kept (one after a plain step, up to k + 1 after a check that kept every
guess), whose last gives the first guess. Then every guessing request chains its guesses together,
one call per further guess, each fed the layer's own output and its last guess. A refused guess's
pairs are overwritten by the next catch-up, as the model's cache is by the next step.

Prefix caching is off with this method: a chunk the model reused has no hidden states to feed.
"""

from dataclasses import dataclass, field

import torch

from .draft_speculation import ModelGuesses
from .speculative import SpeculativeConfig


@dataclass
class _Row:
    seq: object
    limit: int  # guesses wanted
    position: int  # where the next chained pair goes in the layer's cache
    hidden: torch.Tensor  # [D] the layer's last output, to chain from
    guesses: list[int] = field(default_factory=list)
    drawn_from: list = field(default_factory=list)


class MtpSpeculator(ModelGuesses):
    reads_hidden = True

    def __init__(self, config: SpeculativeConfig, graphs):
        """graphs: the model's PredictionGraphs (mtp_graphs.py)."""
        super().__init__(config)
        self.graphs = graphs

    def prefilled(self, seq, tokens: list[int], start: int, hidden=None) -> None:
        self._keep(seq, start, hidden)
        state = seq.guessing
        ready = len(state.hidden) - 1  # pairs whose next token is in the prompt so far
        if ready > 0:
            first = state.draft_position
            self.graphs.catch_up(seq.slot, seq.feed[first + 1:first + 1 + ready], state.hidden[:ready], first)
            state.draft_position, state.hidden = first + ready, state.hidden[ready:]

    def stepped(self, seq, start: int, hidden) -> None:
        self._keep(seq, start, hidden)

    @staticmethod
    def _keep(seq, start: int, hidden: torch.Tensor) -> None:
        """Hold `hidden` [n, D] (positions start..) in place of what was held from `start` on."""
        state = seq.guessing
        if state.hidden is None or start < state.draft_position:  # a new request, or one prefilled again
            state.draft_position, state.hidden = start, hidden.clone()
            return
        held = start - state.draft_position
        if held > len(state.hidden):
            raise RuntimeError(f"mtp: hidden states of positions {state.draft_position + len(state.hidden)}.."
                               f"{start - 1} were never fed back (was a prompt chunk reused from the prefix cache?)")
        state.hidden = torch.cat([state.hidden[:held], hidden])

    def guesses(self, rows) -> dict[int, list[int]]:
        active = []
        for seq, context, limit, position in self.guessing_now(rows):
            # The pair of the token this step feeds (at `position`) waits for the token after it.
            state = seq.guessing
            first, count = state.draft_position, position - state.draft_position
            logits, out = self.graphs.catch_up(seq.slot, context[first + 1:position + 1], state.hidden[:count], first)
            state.draft_position, state.hidden = position, state.hidden[count:]
            row = _Row(seq, min(limit, self.config.num_speculative_tokens), position, out)
            row.guesses.append(self.guess_from(seq, logits, row.drawn_from))
            active.append(row)
        while unfinished := [row for row in active if len(row.guesses) < row.limit]:
            tokens, positions = self.graphs.runner.idle_decode_rows()  # [slots] each
            hidden = torch.zeros(len(tokens), active[0].hidden.shape[-1], dtype=active[0].hidden.dtype)  # [slots, D]
            for row in unfinished:
                slot = row.seq.slot
                tokens[slot], positions[slot], hidden[slot] = row.guesses[-1], row.position, row.hidden
            logits, out = self.graphs.chain(tokens, hidden, positions, max(row.position for row in unfinished) + 1)
            for row in unfinished:
                row.position += 1
                row.hidden = out[row.seq.slot]
                row.guesses.append(self.guess_from(row.seq, logits[row.seq.slot], row.drawn_from))
        self.keep_proposals({id(row.seq): row.drawn_from for row in active})
        return {id(row.seq): row.guesses for row in active}
