"""Guesses from a draft model: a smaller or more quantized model with the same tokenizer decodes
a few tokens greedily ahead of the model, which then checks them in one verify call.

The draft keeps a KV cache of its own with the same slots as the model's. It is prefilled with
every prompt chunk the engine prefills; each step it is fed what it has not seen of the request
(at most the guess it made last and the model's own token after it, more only where the request
went without guesses for a while), then decodes its guesses, all slots in one decode call per
token. Of its guesses it keeps in its cache the ones the check kept: the rest are overwritten
later, as in the model's cache.

For a greedy request the guesses are the draft's greedy choices. For a sampling request each
guess is drawn from the draft's own distribution q under the request's temperature, top-k and
top-p, and the check keeps it with probability min(1, p / q) (sampling.check_guess): where the
draft agrees with the model, most guesses are kept even at a high temperature, where a greedy
guess would be kept only with the model's probability of it. Either way the output is
distributed as the model's.
"""

from dataclasses import dataclass, field

import torch

from .sampling import probabilities
from .speculative import GuessState, Speculator, SpeculativeConfig

# A request that went this many tokens without the draft (guesses off after misses, near its end)
# catches up with one prefill call of the draft instead of as many decode calls.
_PREFILL_LAG = 4


@dataclass
class _DraftRow:
    seq: object
    state: GuessState
    feed: list[int]  # context tokens the draft is still to be fed this step, the step's token last
    position: int  # where the next fed token goes in the draft's cache
    limit: int  # guesses wanted
    guesses: list[int] = field(default_factory=list)
    drawn_from: list = field(default_factory=list)  # a sampling request's: each guess's q [V]


class ModelGuesses(Speculator):
    """Guesses a model makes from its logits (a draft model's, an MTP layer's): for a greedy
    request its argmax; for a sampling one a token drawn from q, the distribution the request's
    settings give those logits, which the check's rejection rule then needs (`proposals`)."""

    guessing_takes_steps = True

    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        self._drawn_from: dict[int, list] = {}  # this step's sampled guesses' distributions, by id(seq)

    @staticmethod
    def guess_from(seq, logits: torch.Tensor, drawn_from: list) -> int:
        """The next guess for `seq` from logits [V]; a sampled guess's q [V] goes to `drawn_from`."""
        sampling = seq.request.sampling
        if sampling.greedy:
            return int(logits.argmax())
        q = probabilities(logits[None], sampling)[0]  # [V]
        drawn_from.append(q)
        return int(torch.multinomial(q, 1, generator=seq.generator))

    @staticmethod
    def guessing_now(rows) -> list:
        """(sequence, its context, its limit, the position its step feeds) of each of `rows` (as
        `guesses` gets them) that guesses this step: not one resting after failed guesses."""
        return [(seq, context, limit, len(context) - 1) for seq, context, limit in rows if seq.guessing.next_guesses()]

    def keep_proposals(self, drawn: dict[int, list]) -> None:
        """This step's sampled guesses' distributions, by id(seq) (empty lists: greedy requests)."""
        self._drawn_from = {key: qs for key, qs in drawn.items() if qs}

    def proposals(self, seq) -> list | None:
        return self._drawn_from.get(id(seq))


class DraftSpeculator(ModelGuesses):
    def __init__(self, config: SpeculativeConfig, draft):
        """draft: the CompiledModel that guesses (compile_model made it with the model's slots
        and cache length)."""
        super().__init__(config)
        self.draft = draft

    def prefilled(self, seq, tokens: list[int], start: int, hidden=None) -> None:
        state = seq.guessing
        if start > state.draft_position:  # the model reused cached chunks the draft may not hold
            tokens, start = seq.feed[state.draft_position:start] + tokens, state.draft_position
        self.draft.prefill_chunk(tokens, start, seq.slot)
        state.draft_position = start + len(tokens)

    def guesses(self, rows) -> dict[int, list[int]]:
        active = []
        for seq, context, limit, position in self.guessing_now(rows):
            state = seq.guessing
            behind = context[state.draft_position:position]
            if len(behind) > _PREFILL_LAG:
                self.draft.prefill_chunk(behind, state.draft_position, seq.slot)
                state.draft_position, behind = position, []
            state.draft_fed = position + 1
            active.append(_DraftRow(seq, state, behind + [context[-1]], position - len(behind),
                                    min(limit, self.config.num_speculative_tokens)))
        while unfinished := [row for row in active if len(row.guesses) < row.limit]:
            tokens, positions = self.draft.idle_decode_rows()  # [slots] each
            for row in unfinished:
                tokens[row.seq.slot] = row.feed.pop(0) if row.feed else row.guesses[-1]
                positions[row.seq.slot] = row.position
            logits = self.draft.decode_step(tokens, positions, max(row.position for row in unfinished) + 1)
            for row in unfinished:
                row.position += 1
                if not row.feed:  # it was fed the step's token or a guess: what comes next is a guess
                    row.guesses.append(self.guess_from(row.seq, logits[row.seq.slot], row.drawn_from))
        self.keep_proposals({id(row.seq): row.drawn_from for row in active})
        return {id(row.seq): row.guesses for row in active}

    def record(self, seq, guessed: int, accepted: int) -> None:
        super().record(seq, guessed, accepted)
        state = seq.guessing
        # The draft was fed its first guessed - 1 guesses after the step's token; the kept ones stay.
        state.draft_position = state.draft_fed + min(accepted, guessed - 1)
