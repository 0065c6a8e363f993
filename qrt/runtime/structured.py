"""Structured output: a request's text held to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a Lark grammar, by masking at each step the tokens that
cannot continue it. The grammar engine is llguidance (the one llama.cpp and vLLM use): masking a
row of the default model's 49,152 logits takes about 0.1 ms (bench/probes/structured_mask.py), against a
decode step of several milliseconds.

A request carries its grammar as llguidance's JSON text (hashable, checked when the request is
made); the engine keeps a matcher per sequence, masks the logits after the request's own
adjustments, and ends the request when the grammar can take nothing more.
"""

import functools
import re

import llguidance
import torch

# JSON without free whitespace: a model may otherwise fill its token budget with spaces and
# newlines, which a schema allows between any two tokens.
_COMPACT = {"whitespace_flexible": False}

# llguidance's resource limits for every grammar qrt compiles, below its defaults where a grammar
# could otherwise cost a server a second of one thread or hundreds of MB: building the lexer's
# expressions (initial fuel; `(a{1000}){1000}` took 0.8 s at the default 1,000,000, 0.08 s at
# 200,000) and its states (1–2 kB each; the default 250,000 allows 500 MB). The per-step limits
# (lexer fuel, Earley items) stay at llguidance's defaults, a few ms of one mask. A grammar over a
# limit puts its matcher in an error state, which check() and the engine report.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=200_000, max_lexer_states=50_000)


def json_schema(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)


def json_object() -> str:
    return json_schema({"type": "object"})


def regex(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice(options: list[str]) -> str:
    return regex("|".join(f"(?:{re.escape(option)})" for option in options))


def lark(grammar: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(grammar)


def check(grammar: str) -> None:
    """Raise ValueError with llguidance's message when `grammar` cannot be compiled."""
    error = _validation(grammar)
    if error:
        raise ValueError(f"the structured-output grammar is invalid: {error}")


@functools.lru_cache(maxsize=8)
def _validation(grammar: str) -> str:
    # Cached: a request of n choices checks its grammar once per choice, and a large one (an enum
    # of 50,000 strings) takes 0.15 s.
    return llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)


class GrammarTokenizer:
    """llguidance's view of a model's vocabulary, made once per tokenizer (about half a second)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        # Imported only once a request asks for structured output: llguidance.hf loads parts of
        # transformers, which would otherwise join every start-up (about 0.4 s, `python -X importtime`).
        import llguidance.hf
        import llguidance.torch  # noqa: F401  (GrammarState's masks)

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)

    def matcher(self, grammar: str) -> "GrammarState":
        return GrammarState(llguidance.LLMatcher(self.tokenizer, grammar, limits=LIMITS), self.vocab_size)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._raise_on_error()

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 with every token the grammar cannot take next at -inf."""
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        logits = logits.clone().view(1, -1)
        llguidance.torch.apply_token_bitmask_inplace(logits, self.mask)
        return logits[0]

    def first_step(self) -> None:
        """Mask the first token and take the lowest id the grammar allows: where a lazily built
        lexer pays for its regular expressions, and where grammars over llguidance's limits
        (LIMITS) fail. A server tries a grammar this far before it queues the request; raises
        ValueError when the grammar fails."""
        row = self.masked(torch.zeros(self.vocab_size))
        self._raise_on_error()
        self.accept(int(row.argmax()))  # argmax: the first of the allowed tokens' equal zeros

    def accept(self, token: int) -> bool:
        """Take the sampled token; True once the grammar is complete (nothing may follow)."""
        self.matcher.consume_token(token)
        self._raise_on_error()
        return self.matcher.is_stopped()

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"structured output: {self.matcher.get_error()}")
