"""Continuous batching over a CompiledModel's graphs.

The KV cache holds `max_batch_size` slots, each with positions of its own. Every step runs
  1. prefill chunks of newly admitted requests (each chunk its own call of the prefill graph,
     at most `chunk_size` tokens in all, so a long prompt stalls running streams by one chunk);
  2. one call of the decode graph over every slot (B = slots, idle slots masked), for the
     requests that were decoding when the step began (where only one is, and the kernels allow,
     the graph of its slot alone: the same bits for less work); with speculative decoding, where some
     request has guesses for its next tokens, one call of the verify graph instead, which feeds
     each slot its next token and guesses (speculative.py);
then samples each request's next token with its own parameters (or, after a check, keeps the
guesses the model agrees with and samples one token after them). Requests join and leave between
steps; the graphs' shapes never change, so nothing recompiles as they do.

Each request's output depends only on its own prompt and parameters: its prefill chunks are
planned from its prompt length alone, and decode rows do not mix. A prompt that starts with whole
chunks a free slot still holds skips them (prefix_cache.py), with the same result bit for bit.
`CompiledModel.generate` is one request through this same engine.

Not thread-safe: one thread calls `submit` and `step` (the server's engine thread); `cancel` may be
called from anywhere.
"""

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .distributed import broadcast_from_first
from .draft_speculation import DraftSpeculator
from .logprobs import TokenLogprob, scored
from .mtp_speculation import MtpSpeculator
from .sampling import SamplingParams, adjusted, check_guess, sample
from .speculative import GuessState, Speculator
from .structured import GrammarState, GrammarTokenizer
from .text_stream import TextStream

DEFAULT_CHUNK = 256  # prefill tokens per step

# Why a request ended (the OpenAI API's finish_reason, plus the two that are the server's own).
STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()  # ending on one of these keeps it in the ids, not in the text
    stop_strings: tuple[str, ...] = ()
    text: bool = False  # also turn the ids into text (needed for stop strings)
    logprobs: int | None = None  # each new token's log-probability and this many alternatives; None: off
    # The prompt's tokens scored too (the first has none), with this many alternatives; None: off.
    # With max_tokens 0 the request ends after its prompt, generating nothing.
    prompt_logprobs: int | None = None
    grammar: str | None = None  # structured output: llguidance's grammar text (structured.py); None: free text
    lora: str | None = None  # the LoRA adapter it runs with, by name (runtime/lora.py); None: the base alone


@dataclass
class Update:
    """What one step did to one request: a new token (and the text it made safe to show), and
    whether the request ended."""
    token: int | None
    text: str
    finish_reason: str | None
    time: float  # time.perf_counter() when it happened
    error: BaseException | None = None
    logprob: TokenLogprob | None = None  # the new token's, when the request asked for log-probabilities


@dataclass
class Sequence:
    """One request's way through the engine. `listener` (called on the engine's thread) gets
    each Update; `tokens` and `text` hold everything so far."""
    request: Request
    listener: object = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `tokens`, when asked for
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # of the prompt, when asked for
    finish_reason: str | None = None
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    # Engine bookkeeping.
    slot: int | None = None
    feed: list[int] = field(default_factory=list)  # tokens still to prefill
    chunks: deque = field(default_factory=deque)  # planned prefill chunks: (start, end) within feed
    position: int = 0  # the cache position the next fed token goes to
    next_token: int | None = None  # the token the next decode step feeds
    generator: torch.Generator | None = None
    stream: TextStream | None = None
    grammar: GrammarState | None = None
    guessing: GuessState = field(default_factory=GuessState)  # speculative decoding's record for it
    cancelled: bool = False
    adapter: object = None  # its LoRA adapter (lora.Resident) while it holds a slot

    def cancel(self) -> None:
        """Ask the engine to drop this request; it frees the slot at the start of its next step."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def plan_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """Split `length` prompt tokens into prefill chunks of at most `chunk`, none of one token
    (the prefill graph's length is dynamic from 2: a lone remaining token moves into the chunk
    before it). A one-token prompt is one chunk of one (run with a filler token after it, see
    GraphRunner.prefill_inputs)."""
    bounds = list(range(0, length, chunk)) + [length]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        bounds[-2] -= 1
    return list(zip(bounds[:-1], bounds[1:]))


# Each speculative method's speculator, from its config and the model (speculative.py).
_SPECULATORS = {"ngram": lambda config, model: Speculator(config),
                "draft": lambda config, model: DraftSpeculator(config, model.draft),
                "mtp": lambda config, model: MtpSpeculator(config, model.mtp)}


class Engine:
    def __init__(self, model, chunk_size: int = DEFAULT_CHUNK, tokenizer=None, prefix_caching: bool = True,
                 speculate: bool = True):
        """model: a CompiledModel, whose graph runner (graph_runner.py) the engine steps and whose
        end-of-sequence ids and tokenizer it reads. tokenizer: what turns ids into text (default: the model's). prefix_caching: skip the
        whole prefill chunks a free slot holds already (prefix_cache.py; the same results).
        speculate: guess and check tokens where the model was compiled with speculative decoding
        (False: decode one token a step anyway)."""
        if chunk_size < 3:
            raise ValueError(f"chunk_size must be at least 3 tokens, got {chunk_size}")
        self.model = model
        self.chunk_size = chunk_size
        self.prefix_caching = prefix_caching
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        self.slots: list[Sequence | None] = [None] * model.max_batch_size
        self.prefix_cache = model.prefix_cache  # the model's KV cache's, shared by every engine over it
        self._grammar_tokenizer: GrammarTokenizer | None = None  # made when a request first needs it
        self.waiting: deque[Sequence] = deque()
        # Longrope models (Phi-3) switch to long factors past the original context, for every
        # position of the sequence (as transformers does): a prompt past it prefills in one
        # chunk, and a sequence that grows past it is prefilled again from the start.
        self.long_from = model.long_from
        config = getattr(model, "speculative", None)
        self.speculator = None
        if speculate and config is not None:
            self.speculator = _SPECULATORS[config.method](config, model)
            # A chunk reused from the prefix cache has no hidden states for a speculator to read.
            self.prefix_caching = prefix_caching and not self.speculator.reads_hidden

    # ---- what callers use -----------------------------------------------------------------------
    def submit(self, request: Request, listener=None) -> Sequence:
        """Queue a request (checked by the caller: prompt + max_tokens fit the cache)."""
        return self.add(Sequence(request, listener))

    def add(self, seq: Sequence) -> Sequence:
        request = seq.request
        if request.sampling.seed is not None:
            seq.generator = torch.Generator().manual_seed(request.sampling.seed)
        if request.text or request.stop_strings:
            seq.stream = TextStream(self.tokenizer, request.stop_strings)
        if request.grammar is not None:
            self._guarded(seq, self._start_grammar, seq)
        if not seq.done:  # a grammar that failed to start has ended the request
            self.waiting.append(seq)
        return seq

    def _start_grammar(self, seq: Sequence) -> None:
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.model.vocab_size, self.model.eos_ids)
        seq.grammar = self._grammar_tokenizer.matcher(seq.request.grammar)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.slots)

    def run(self, sequences) -> None:
        """Step until every one of `sequences` is done (synchronous callers: generate)."""
        while not all(seq.done for seq in sequences):
            self.step()

    def speculation_counts(self) -> tuple[int, int, int]:
        """(Guesses checked, guesses kept, verify calls) so far; zeros without speculation."""
        spec = self.speculator
        return (spec.proposed, spec.accepted, spec.checks) if spec is not None else (0, 0, 0)

    def live(self) -> list[Sequence]:
        """The requests in hand: in a slot or waiting for one."""
        return [s for s in self.slots if s is not None] + list(self.waiting)

    def step(self, cancelled: list[Sequence] | None = None) -> None:
        """One round: drop cancelled requests, admit waiting ones, prefill, decode, sample.

        cancelled: the requests to drop; None: those marked with `cancel()`. The ranks of a
        sharded model pass the list rank 0 sent (qrt/server/lockstep.py), so that all drop the
        same requests at the same step however late a mark came."""
        dropping = [s for s in self.live() if s.cancelled] if cancelled is None else cancelled
        for seq in dropping:
            if not seq.done:
                self._finish(seq, CANCELLED)
        self._admit()
        decoding = [s for s in self.slots if s is not None and s.next_token is not None]
        self._restart_past_long_context(decoding)
        decoding = [s for s in decoding if s.next_token is not None]
        # [(sequence, logits [1 + guesses, V], its guesses, whether it fed a token to the cache)]
        scored_rows = self._prefill_step() + self._decode_step(decoding)
        picked = [(seq, logits, guesses, fed, self._guarded(seq, self._choose, seq, logits, guesses))
                  for seq, logits, guesses, fed in scored_rows]
        picked = [row for row in picked if row[-1] is not None]
        if not picked:
            return
        # Rank 0's choices on every rank, one row per request: how many tokens, then the tokens.
        width = 1 + max(len(row[2]) for row in picked)
        chosen = torch.full((len(picked), 1 + width), -1, dtype=torch.long)  # [n, 1 + width]
        for row, (*_, tokens) in enumerate(picked):
            chosen[row, 0] = len(tokens)
            chosen[row, 1:1 + len(tokens)] = torch.tensor(tokens)
        chosen = broadcast_from_first(chosen, self.model.parallel).tolist()
        now = time.perf_counter()
        for (seq, logits, guesses, fed, _), (count, *tokens) in zip(picked, chosen):
            tokens = tokens[:count]
            if guesses:
                self.speculator.record(seq, len(guesses), count - 1)
            if fed:
                seq.position += count  # the fed token and the guesses kept are in the cache now
            for place, token in enumerate(tokens):
                top = seq.request.logprobs
                logprob = None if top is None else self._guarded(
                    seq, lambda: scored(logits[place][None], [token], top)[0])
                self._guarded(seq, self._accept, seq, token, now, logprob)

    def fail_all(self, err: BaseException) -> None:
        """End every request in hand with `err` (the caller's step failed outside any one request)."""
        for seq in self.live():
            self._fail(seq, err)

    # ---- scheduling -------------------------------------------------------------------------------
    def _admit(self) -> None:
        free = [slot for slot, held in enumerate(self.slots) if held is None]
        while free and self.waiting:
            seq = self.waiting.popleft()
            prompt = list(seq.request.prompt)
            adapters = self.model.lora
            if adapters is not None:
                seq.adapter = self._guarded(seq, adapters.resident, seq.request.lora)
                if seq.done:  # its adapter was unloaded while it waited
                    continue
            elif seq.request.lora is not None:
                self._fail(seq, ValueError(f"LoRA adapter {seq.request.lora!r} asked of a model compiled "
                                           f"without LoRA slots (compile_model's lora=, max_loras=)"))
                continue
            # A prompt that is scored must be prefilled from its first token.
            reuse = self.prefix_caching and seq.request.prompt_logprobs is None
            starts = [start for start, _ in self._plan(len(prompt))] if reuse else [0]
            # Keys and values depend on the adapter: a prefix is reused only under the same one.
            tag = None if seq.adapter is None else seq.adapter.identity
            slot, reused = self.prefix_cache.choose(free, prompt, starts, self.chunk_size, tag)
            free.remove(slot)
            seq.slot = slot
            self.slots[slot] = seq
            if adapters is not None:
                adapters.bind(slot, seq.adapter)
            self._start_prefill(seq, prompt, reused)

    def _plan(self, length: int) -> list[tuple[int, int]]:
        whole = self.long_from is not None and length > self.long_from
        return plan_chunks(length, length if whole else self.chunk_size)

    def _start_prefill(self, seq: Sequence, tokens: list[int], reused: int = 0) -> None:
        """Plan `tokens`' prefill; the first `reused` (a chunk start) are in the slot already."""
        seq.feed, seq.position, seq.next_token = tokens, reused, None
        seq.chunks = deque((start, end) for start, end in self._plan(len(tokens)) if start >= reused)

    def _restart_past_long_context(self, decoding) -> None:
        for seq in decoding:
            if self.long_from is not None and seq.position == self.long_from:
                self._start_prefill(seq, list(seq.request.prompt) + seq.tokens)  # one chunk: past long_from

    def _prefill_step(self) -> list:
        """Run planned chunks, oldest request first, while the step's token budget lasts (the
        first chunk always runs). Returns (sequence, logits) of those whose prompt is done."""
        budget, done = self.chunk_size, []
        for seq in sorted((s for s in self.slots if s is not None and s.chunks), key=lambda s: s.submitted):
            while seq.chunks and (budget == self.chunk_size or seq.chunks[0][1] - seq.chunks[0][0] <= budget):
                start, end = seq.chunks.popleft()
                budget -= end - start
                # A prompt is scored on its first way through (not when a long context restarts it).
                scoring = seq.request.prompt_logprobs is not None and not seq.tokens
                with_hidden = scoring or (self.speculator is not None and self.speculator.reads_hidden)
                out = self._guarded(seq, self.model.prefill_chunk, seq.feed[start:end], start, seq.slot, with_hidden)
                if out is not None and scoring:
                    self._guarded(seq, self._score_prompt, seq, out[1], start)
                if seq.done:  # the chunk or its scoring failed, which ended the request
                    break
                self.prefix_cache.extend(seq.slot, start, seq.feed[start:end], self.chunk_size)
                if self.speculator is not None:
                    self._guarded(seq, self.speculator.prefilled, seq, seq.feed[start:end], start,
                                  out[1] if with_hidden else None)
                    if seq.done:  # a draft model's prefill failed
                        break
                logits = out[0] if with_hidden else out
                seq.position = end
                if not seq.chunks:
                    if seq.request.max_tokens == 0:  # scoring the prompt was all it asked for
                        self._finish(seq, LENGTH)
                    else:
                        done.append((seq, logits[None], [], False))
            if budget <= 0:
                break
        return done

    def _decode_step(self, decoding) -> list:
        if not decoding:
            return []
        if self.speculator is not None:
            rows = [(seq, list(seq.request.prompt) + seq.tokens, room) for seq in decoding
                    if (room := self._guess_room(seq)) > 0]
            # Guesses that cost steps of their own (a draft's) are weighed before they are made, at
            # the most each request could guess; looked-up ones after, at what was found.
            costly = self.speculator.guessing_takes_steps
            if rows and (not costly or self._check_pays(decoding, [room for *_, room in rows])):
                started = time.perf_counter()  # a check's time counts its guessing (a draft's steps)
                guesses = self.speculator.guesses(rows)
                found = [len(g) for g in guesses.values() if g]
                if found and (costly or self._check_pays(decoding, found)):
                    return self._feed(decoding, guesses, started)
        return self._feed(decoding, {}, time.perf_counter())

    def _one_slot(self, decoding) -> bool:
        """Whether this step's one decoding request runs through the graphs of its slot alone."""
        return len(decoding) == 1 and self.model.one_slot_exact

    def _check_pays(self, decoding, counts: list[int]) -> bool:
        """Whether guessing and checking is expected to give more tokens per second than a plain
        step (speculative.CheckCosts), for requests that guess up to `counts` tokens each.
        The ranks of a sharded model must choose alike, and their clocks differ: there every
        check runs."""
        if self.model.parallel.sharded:
            return True
        plain, check = ("decode_slot", "verify_slot") if self._one_slot(decoding) else ("decode", "verify")
        limit = self.speculator.config.num_speculative_tokens
        return self.speculator.costs.pays(plain, check, len(decoding), [min(count, limit) for count in counts],
                                          self.speculator.kept_share)

    def _timed(self, graph: str, started: float) -> None:
        if self.speculator is not None:
            self.speculator.costs.observe(graph, time.perf_counter() - started)

    def _feed(self, decoding, guesses: dict, started: float) -> list:
        """One call of a step graph: each decoding request's next token, and its guesses where any
        request has some (the verify graph; else decode). Where one request decodes and the
        kernels allow, the graph of its slot alone. started: when the step began, guessing
        included (the call's time, for CheckCosts)."""
        width = self.speculator.config.width if guesses else 1
        tokens, positions = self.model.idle_rows(width)  # [slots, width] each
        fed = {id(seq): [seq.next_token, *guesses.get(id(seq), [])] for seq in decoding}
        for seq in decoding:
            count = len(fed[id(seq)])
            tokens[seq.slot, :count] = torch.tensor(fed[id(seq)])
            positions[seq.slot, :count] = torch.arange(seq.position, seq.position + count)
        attended = max(seq.position + len(fed[id(seq)]) for seq in decoding)  # the furthest place + 1
        alone = decoding[0].slot if self._one_slot(decoding) else None
        graph = ("verify" if guesses else "decode") + ("_slot" if alone is not None else "")
        try:
            logits = self._call(graph, tokens, positions, attended, alone)  # [slots, or 1 alone, width, V]
            self._timed(graph, started)
        except Exception as err:  # noqa: BLE001  (a failed step fails its requests, not the engine)
            for seq in decoding:
                self._fail(seq, err)
            return []
        if guesses:
            self.speculator.checks += 1
        if self.speculator is not None and self.speculator.reads_hidden:
            hidden = self.model.last_hidden  # [slots, or 1 alone, width, D]
            for seq in decoding:
                self._guarded(seq, self.speculator.stepped, seq, seq.position,
                              hidden[seq.slot if alone is None else 0, :len(fed[id(seq)])])
        return [(seq, logits[seq.slot if alone is None else 0, :len(fed[id(seq)])], guesses.get(id(seq), []), True)
                for seq in decoding]

    def _call(self, graph: str, tokens, positions, attended: int, alone: int | None) -> torch.Tensor:
        """The model's call of `graph` on tokens, positions [slots, W] (of slot `alone` only, for
        the slot graphs): float32 logits [slots, W, V], or [1, W, V] alone."""
        model = self.model
        if graph == "decode":
            return model.decode_step(tokens[:, 0], positions[:, 0], attended)[:, None]
        if graph == "decode_slot":
            return model.decode_slot(alone, int(tokens[alone, 0]), int(positions[alone, 0]))[None, None]
        if graph == "verify":
            return model.verify_step(tokens, positions, attended)
        return model.verify_slot(alone, tokens[alone], positions[alone], attended)[None]

    def _guess_room(self, seq: Sequence) -> int:
        """How many guesses of what follows `seq`'s next token this step could be kept: its
        remaining tokens, the cache and a long-context restart bound it; none under a grammar."""
        if seq.grammar is not None:
            return 0
        room = min(seq.request.max_tokens - len(seq.tokens), self.model.max_seq_len - 1 - seq.position) - 1
        if self.long_from is not None and seq.position < self.long_from:
            room = min(room, self.long_from - seq.position - 1)  # land on long_from, not past it
        return room

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        """Each prompt token that follows this chunk's positions, scored from their hidden
        states [T, D]; the prompt's first token gets None (nothing comes before it)."""
        prompt = seq.request.prompt
        if start == 0:
            seq.prompt_logprobs = [None]
        rows = min(start + hidden.shape[0], len(prompt) - 1) - start  # the last prompt token predicts no prompt token
        if rows > 0:
            logits = self.model.position_logits(hidden[:rows])  # [rows, V]
            seq.prompt_logprobs += scored(logits, list(prompt[start + 1:start + 1 + rows]), seq.request.prompt_logprobs)

    def _choose(self, seq: Sequence, logits: torch.Tensor, guesses: list[int]) -> list[int]:
        """The tokens this step gives `seq` from its logits [1 + len(guesses), V]: each guess the
        model agrees with (sampling.check_guess, against the distribution the guess was drawn
        from where the speculator sampled it), then one token of the model's own choice."""
        request, output, chosen = seq.request, list(seq.tokens), []
        proposals = self.speculator.proposals(seq) if guesses else None
        for place, row in enumerate(logits):
            if request.sampling.adjusts:
                row = adjusted(row, request.sampling, request.prompt, output, request.stop_ids)
            if place == len(guesses):
                if seq.grammar is not None:
                    row = seq.grammar.masked(row)
                chosen.append(int(sample(row.view(1, -1), request.sampling, seq.generator)[0]))
                break
            token, agreed = check_guess(row, request.sampling, seq.generator, guesses[place],
                                        proposals[place] if proposals else None)
            chosen.append(token)
            output.append(token)
            if not agreed:
                break
        return chosen

    # ---- a request's own progress ------------------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, now: float, logprob: TokenLogprob | None = None) -> None:
        if seq.done:  # failed or was cancelled during this step
            return
        seq.tokens.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        request = seq.request
        stop_token = token in request.stop_ids  # kept in the ids, not in the text
        text = seq.stream.add(token) if seq.stream is not None and not stop_token else ""
        reason = None
        complete = seq.grammar is not None and seq.grammar.accept(token)
        if complete or stop_token or (seq.stream is not None and seq.stream.stopped):
            reason = STOP
        elif len(seq.tokens) >= request.max_tokens:
            reason = LENGTH
        if reason is not None and seq.stream is not None:
            text += seq.stream.flush()
        seq.text += text
        seq.next_token = token
        self._notify(seq, Update(token, text, None, now, logprob=logprob))
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        if seq.adapter is not None and seq.slot is not None:  # its adapter's slot may free now
            self.model.lora.bind(seq.slot, None)
        seq.adapter = None
        if seq.slot is not None:
            self.slots[seq.slot] = None
            self.prefix_cache.freed(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason, seq.error, seq.next_token, seq.chunks = reason, error, None, deque()
        self._notify(seq, Update(None, "", reason, time.perf_counter(), error))

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        if not seq.done:
            self._finish(seq, ERROR, err)

    def _guarded(self, seq: Sequence, fn, *args):
        """fn(*args); an exception fails this request only, and gives None."""
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001  (one request's fault must not stop the others)
            self._fail(seq, err)
            return None

    @staticmethod
    def _notify(seq: Sequence, update: Update) -> None:
        if seq.listener is not None:
            try:
                seq.listener(update)
            except Exception:  # noqa: BLE001  (a listener's fault is its own; the engine goes on)
                seq.cancel()
