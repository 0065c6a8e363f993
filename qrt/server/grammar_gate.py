"""A request's structured-output grammar, made and tried before the request is queued: off the
event loop, against the model's vocabulary, within llguidance's limits (structured.LIMITS) and a
wall-clock limit. A grammar that fails, goes over a limit or takes too long is the request's 400,
found here rather than as an error from the engine thread after the request had taken a slot.

The trial builds the grammar's matcher, its first mask and its first token, where the costly
parts are (the lexer is built lazily, so a hostile regex costs its time at the first mask, not
before) and where a grammar over llguidance's limits fails.
At most WORKERS trials run at once; a trial that runs past the time limit still holds its
worker until llguidance's limits end it, so hostile grammars cannot pile up threads."""

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

from qrt.runtime import structured

from .api_errors import ApiError
from .budgets import RETRY_AFTER_S

TIMEOUT_S = 10.0  # a trial's wall-clock limit: llguidance's limits end the worst in about a second
WORKERS = 2
# The fields that ask for structured output, in the order protocol.py reads them: the first one
# a request sets is the one its grammar's errors name.
_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "tool_choice")


class GrammarGate:
    def __init__(self, model, timeout_s: float = TIMEOUT_S):
        # The tokenizer is copied here, on the event loop's thread: the original serves that
        # thread's encoding, and a Rust tokenizer must not be used by two threads at once.
        self._tokenizer_source = copy.deepcopy(model.tokenizer)
        self._vocab_size, self._eos_ids = model.vocab_size, model.eos_ids
        self._grammar_tokenizer = None  # llguidance's view of the vocabulary, made by the first trial
        self._made = threading.Lock()
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="qrt-grammar")
        self._free = asyncio.Semaphore(WORKERS)

    async def grammar(self, body) -> str | None:
        """`body`'s grammar (protocol.py's `grammar()`), tried; None when it asks for none."""
        if not any(_asks(body, name) for name in _FIELDS):
            return None
        param = next(name for name in _FIELDS if _asks(body, name))
        try:
            await asyncio.wait_for(self._free.acquire(), self.timeout_s)
        except TimeoutError:
            raise ApiError(503, f"every grammar compiler has been busy for {self.timeout_s:.0f} s; retry shortly",
                           "server_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        trial = asyncio.get_running_loop().run_in_executor(self._pool, self._try, body)
        trial.add_done_callback(lambda _: self._free.release())
        try:
            return await asyncio.wait_for(asyncio.shield(trial), self.timeout_s)
        except TimeoutError:
            raise ApiError(400, f"the structured-output grammar did not compile within {self.timeout_s:.0f} s; "
                                f"simplify it", param=param) from None
        except ValueError as err:
            raise ApiError(400, str(err), param=param) from None

    def _try(self, body) -> str | None:  # a worker thread
        try:
            grammar = body.grammar()
        except RecursionError:  # a schema within the body's nesting but past Python's while compiled
            raise ValueError("the structured-output schema is nested too deeply") from None
        if grammar is None:
            return None
        structured.check(grammar)
        with self._made:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = structured.GrammarTokenizer(self._tokenizer_source, self._vocab_size,
                                                                      self._eos_ids)
        state = self._grammar_tokenizer.matcher(grammar)  # raises on a grammar the vocabulary cannot take
        state.first_step()
        return grammar


def _asks(body, name: str) -> bool:
    value = getattr(body, name, None)
    if name == "response_format":
        return value is not None and value.get("type") != "text"
    if name == "tool_choice":
        return getattr(body, "tool_mode", lambda: None)() not in (None, "auto")
    return value is not None
