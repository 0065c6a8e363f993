"""Speculative decoding: guess a request's next tokens cheaply, check them all in one call of the
verify graph, and keep the guesses the model itself would have produced.

At batch 1 a decode step reads every weight to make one token, so it is bound by memory
bandwidth; a call that feeds the next token and k guesses after it reads the same weights once
and scores all k + 1 positions. The engine keeps each guess the model agrees with (for greedy
requests: its argmax is the guess; when sampling: the rejection rule in sampling.py, which keeps
the output distribution the model's own), then one token of the model's own choice, so a step
gives a request between 1 and k + 1 tokens, and the tokens are the ones decoding one at a time
would have given.

The guesses come from prompt lookup ("ngram"): the request's last few tokens are looked for
earlier in its prompt and output, and the tokens that followed there are the guess. It costs
nothing to run and pays where the output repeats its input: edits of a given passage or code,
extraction, quoting. Or from a draft model ("draft", draft_speculation.py): a smaller or more
quantized model with the same tokenizer decodes the guesses. Or from the checkpoint's own
multi-token-prediction layer ("mtp", mtp_speculation.py: DeepSeek-V3's), which reads the model's
final hidden states. Names and defaults follow vLLM's `speculative_config`.
"""

from array import array
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft", "mtp")
# After the second check in a row in which a request's guesses all failed, it does not guess for
# 2 steps, after the third 4, and so on (up to this many), so that free text, where lookups keep
# finding a stale match, runs at about the plain decode step's speed. One miss alone does not
# rest: where an answer follows its source, a miss is usually one changed word.
MAX_BACKOFF_STEPS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: guesses checked per step; the verify graph feeds k + 1 tokens
    prompt_lookup_max: int = 4  # the longest tail looked up (ngram)
    prompt_lookup_min: int = 2  # the shortest
    model: str | None = None  # draft: the draft's checkpoint (folder, .gguf; None: the default model)
    quant: str | None = None  # draft: quantize the draft online ("int4" …); a draft of the model's
    # own checkpoint needs one, or it would be the model again

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of {list(METHODS)}")
        if self.method != "draft" and (self.model is not None or self.quant is not None):
            raise ValueError("speculative 'model' and 'quant' are the draft's: they need method 'draft'")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > 15:
            raise ValueError(f"speculative num_speculative_tokens={self.num_speculative_tokens}: at most 15 (each "
                             f"guess widens every verify call, and long guesses are rarely all right)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, spec) -> "SpeculativeConfig | None":
        """compile_model's `speculative` argument: None (off), a config, or a dict of its fields."""
        if spec is None or isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': 3}}, "
                             f"got {type(spec).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative: unknown setting(s) {unknown}; the settings are {sorted(known)}")
        if "method" not in spec and "model" in spec:
            spec = {**spec, "method": "draft"}  # vLLM's form: a draft named by its model alone
        if "method" not in spec:
            raise ValueError(f"speculative needs a 'method', one of {list(METHODS)}")
        return cls(**spec)

    @property
    def width(self) -> int:
        """Tokens per cache row in a verify call: the next token and its guesses."""
        return self.num_speculative_tokens + 1


def prompt_lookup(context: list[int], limit: int, longest: int, shortest: int) -> list[int]:
    """Up to `limit` tokens that followed an earlier occurrence of the context's last n tokens,
    trying n from `longest` down to `shortest`; [] where none occurs. Of the occurrences, the
    latest that is followed by `limit` tokens (one just before the end is followed by few), else
    the one followed by the most."""
    if limit <= 0 or len(context) <= shortest:
        return []
    # bytes.rfind searches in C; a match must start on a token boundary (a multiple of 4 bytes).
    data = array("i", context).tobytes()
    for n in range(min(longest, len(context) - 1), shortest - 1, -1):
        tail = data[-4 * n:]
        end = len(data) - 4  # the match ends before the last token, so that a token follows it
        best: list[int] = []
        while (found := data.rfind(tail, 0, end)) >= 0:
            end = found + len(tail) - 1  # the next search finds an occurrence that starts before this one
            if found % 4:
                continue
            start = found // 4 + n
            follows = context[start:start + limit]
            if len(follows) == limit:
                return follows
            if len(follows) > len(best):
                best = follows
        if best:
            return best
    return []


class CheckCosts:
    """Whether checking this step's guesses is worth its call: the verify graph feeds k + 1 rows
    per slot, which on a busy multi-slot step costs several plain decode steps (2.6 times at 8
    slots on the default model), more than the guesses kept give back. The engine times every
    decode and verify call; a check runs where the tokens it is expected to give per second
    beat the plain step's, or to measure it again after PROBE_EVERY steps without. The time of a
    check includes making its guesses, which for a draft model are decode steps of its own."""

    PROBE_EVERY = 64
    SMOOTHING = 0.2  # weight of each new time in the running average

    def __init__(self):
        self.seconds: dict[str, float] = {}  # graph name -> running average of a call
        self.steps_without = 0  # steps since the last check

    def observe(self, graph: str, seconds: float) -> None:
        old = self.seconds.get(graph)
        self.seconds[graph] = seconds if old is None else old + self.SMOOTHING * (seconds - old)

    def pays(self, plain: str, check: str, rows: int, guesses: list[int], kept_share: float) -> bool:
        """rows: decoding requests; guesses: how many each of those that may guess would guess
        at most; kept_share: the share of guesses kept so far. plain, check: the graphs either
        choice would run (a check's time includes making its guesses)."""
        if plain not in self.seconds or check not in self.seconds or self.steps_without >= self.PROBE_EVERY:
            self.steps_without = 0
            return True
        # Kept guesses come in runs (a passage being copied, a draft in step), so the share kept
        # of each guess is the share kept overall: 1 + r·d tokens for a row of d guesses.
        tokens = rows - len(guesses) + sum(1 + kept_share * count for count in guesses)
        if tokens / self.seconds[check] > rows / self.seconds[plain]:
            self.steps_without = 0
            return True
        self.steps_without += 1
        return False


@dataclass
class GuessState:
    """One request's record of how its guesses fare (for backing off where they fail), and of
    what a draft model's cache holds of it."""
    misses: int = 0  # checks in a row whose guesses all failed
    resting: int = 0  # steps left without guessing
    draft_position: int = 0  # a draft model's cache holds this request's first this many tokens
    draft_fed: int = 0  # the draft fed this step's context up to here before its guesses
    # An MTP layer's: the model's final hidden states [n, D] of positions draft_position.. that it
    # has not been fed yet (each waits for the token after it).
    hidden: object = None

    def next_guesses(self) -> bool:
        if self.resting:
            self.resting -= 1
            return False
        return True

    def checked(self, guessed: int, accepted: int) -> None:
        if not guessed:
            return
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= 2:
            self.resting = min(2 ** (self.misses - 1), MAX_BACKOFF_STEPS)


class Speculator:
    """Makes the decoding requests' guesses for a step, and counts how they fare. This one
    looks them up in each request's own tokens (prompt lookup); draft_speculation.py asks a
    smaller model."""

    guessing_takes_steps = False  # whether making guesses runs a model (then it is weighed first)
    reads_hidden = False  # whether it reads the model's final hidden states (prefilled, stepped)

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposed = 0  # guesses checked
        self.accepted = 0  # of those, kept
        self.checks = 0  # verify calls
        self.costs = CheckCosts()

    @property
    def kept_share(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.5

    def guesses(self, rows) -> dict[int, list[int]]:
        """rows: (sequence, its context, at most how many guesses) for each decoding request,
        the context being its prompt and output so far, ending with the token this step feeds
        (at position len(context) - 1). Returns each sequence's guesses by id(sequence)."""
        return {id(seq): self.guess(seq.guessing, context, limit) if seq.guessing.next_guesses() else []
                for seq, context, limit in rows}

    def guess(self, state: GuessState, context: list[int], limit: int) -> list[int]:
        """At most `limit` (and k) guesses of what follows one request's `context`."""
        config = self.config
        return prompt_lookup(context, min(limit, config.num_speculative_tokens), config.prompt_lookup_max,
                             config.prompt_lookup_min)

    def proposals(self, seq) -> list | None:
        """The distributions [V] that this step's guesses of `seq` were drawn from, by place, for
        the rejection rule (sampling.check_guess); None where each guess was proposed with
        certainty (a lookup, a draft's greedy choice)."""
        return None

    def prefilled(self, seq, tokens: list[int], start: int, hidden=None) -> None:
        """The engine prefilled `tokens` of `seq` from position `start` (a draft model follows);
        hidden: their final hidden states [T, D] where the speculator reads them."""

    def stepped(self, seq, start: int, hidden) -> None:
        """Where it reads hidden states: a step graph fed `seq` tokens from position `start`,
        whose final hidden states are `hidden` [W, D] (those past the tokens the step keeps are
        overwritten by a later call)."""

    def record(self, seq, guessed: int, accepted: int) -> None:
        """A check of `guessed` guesses of `seq` kept the first `accepted`."""
        seq.guessing.checked(guessed, accepted)
        self.proposed += guessed
        self.accepted += accepted
