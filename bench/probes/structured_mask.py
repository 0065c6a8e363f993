"""What structured output costs per decode step: the grammar engine's token mask for each of a
batch's rows, filled and applied to the row's logits, on the default model's vocabulary.

    python -m bench.probes.structured_mask                  # batch 8, a JSON schema, 64 steps
    python -m bench.probes.structured_mask --batch 1 --steps 128
    python -m bench.probes.structured_mask --engines llguidance,xgrammar,outlines-core

Each row follows its own path through the schema (its logits are random, masked, then argmaxed
and consumed, as the engine does), so the masks differ from row to row and step to step; a row
whose JSON is complete starts again, as a new request would take its slot. For each
engine: the seconds to prepare the vocabulary and to compile the schema, then the median and 90th
percentile of one step's masking for the whole batch, in µs. llguidance is the engine qrt runs,
with qrt's vocabulary and matchers (qrt/runtime/structured.py, compact JSON); xgrammar and
outlines-core are measured beside it when they are installed (`pip install xgrammar
outlines-core`, with torch pinned), each asked for JSON without free whitespace too. Every engine
fills its rows of one batch mask, which one function then applies to the batch's logits (qrt's
engine applies each row's mask to that row, so its own cost per step is a little higher).
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch

from bench.measure import name_list, positive_int
from qrt.runtime import structured

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
                   "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                               "required": ["city"]}},
    "required": ["name", "age", "tags", "address"],
}
VOCAB = 49152  # the default model's logits


class Llguidance:
    """qrt's vocabulary and matchers (structured.GrammarTokenizer, a GrammarState per row); the
    mask is filled here into the shared batch mask, where GrammarState.masked fills and applies
    its own row."""

    module = "llguidance"

    def __init__(self, tokenizer):
        self.tokenizer = structured.GrammarTokenizer(tokenizer, VOCAB, {tokenizer.eos_token_id})

    def rows(self, batch: int):
        grammar = structured.json_schema(SCHEMA)
        self.matchers = [self.tokenizer.matcher(grammar) for _ in range(batch)]

    def fill(self, bitmask: torch.Tensor) -> None:
        import llguidance.torch

        for row, state in enumerate(self.matchers):
            llguidance.torch.fill_next_token_bitmask(state.matcher, bitmask, row)

    def accept(self, row: int, token: int) -> None:
        self.matchers[row].accept(token)
        if self.matchers[row].matcher.is_stopped():
            self.matchers[row].matcher.reset()


class Xgrammar:
    module = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.xgrammar = xgrammar
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))

    def rows(self, batch: int):
        compiled = self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        self.matchers = [self.xgrammar.GrammarMatcher(compiled) for _ in range(batch)]

    def fill(self, bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(self.matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, row: int, token: int) -> None:
        self.matchers[row].accept_token(token)
        if self.matchers[row].is_terminated():
            self.matchers[row].reset()


class OutlinesCore:
    """outlines-core indexes a regex over the vocabulary; the schema becomes that regex."""

    module = "outlines_core"

    def __init__(self, tokenizer):
        import outlines_core

        self.outlines = outlines_core
        # Its vocabulary takes each token's bytes: undo the byte-level BPE's printable stand-ins.
        to_byte = {char: byte for byte, char in _byte_level_characters().items()}
        special = set(tokenizer.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, token in tokenizer.get_vocab().items():
            if token not in special and token < VOCAB:
                tokens.setdefault(bytes(to_byte[char] for char in text), []).append(token)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)

    def rows(self, batch: int):
        from outlines_core.json_schema import build_regex_from_schema

        index = self.outlines.Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), self.vocabulary)
        self.guides = [self.outlines.Guide(index) for _ in range(batch)]

    def fill(self, bitmask: torch.Tensor) -> None:
        for row, guide in enumerate(self.guides):
            words = bitmask[row]
            guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())

    def accept(self, row: int, token: int) -> None:
        self.guides[row].advance(token)
        if self.guides[row].is_finished():
            self.guides[row].reset()


def _byte_level_characters() -> dict[int, str]:
    """GPT-2's byte-level BPE writes each byte as a printable character: the printable Latin-1
    bytes as themselves, every other byte as the next unused code point from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + n) for n, byte in enumerate(others)}}


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def run(engine_cls, tokenizer, batch: int, steps: int) -> str:
    started = time.perf_counter()
    engine = engine_cls(tokenizer)
    prepared = time.perf_counter() - started
    started = time.perf_counter()
    engine.rows(batch)
    compiled = time.perf_counter() - started
    import llguidance.torch

    bitmask = llguidance.torch.allocate_token_bitmask(batch, VOCAB)  # [B, ceil(V / 32)] int32
    generator = torch.Generator().manual_seed(0)
    step_us = []
    for _ in range(steps):
        logits = torch.randn(batch, VOCAB, generator=generator)  # [B, V]
        started = time.perf_counter()
        engine.fill(bitmask)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        step_us.append((time.perf_counter() - started) * 1e6)
        for row, token in enumerate(logits.argmax(-1).tolist()):
            engine.accept(row, token)
    step_us.sort()
    median = statistics.median(step_us)
    return (f"vocabulary {prepared:.2f} s, schema {compiled:.2f} s, batch {batch}: {median:.0f} µs per step "
            f"(p90 {step_us[int(0.9 * len(step_us))]:.0f}), {median / batch:.0f} µs per row")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--steps", type=positive_int, default=64)
    parser.add_argument("--engines", type=name_list(ENGINES), default=",".join(ENGINES))
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from qrt.runtime.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path(progress=False)))
    for name in args.engines:
        engine_cls = ENGINES[name]
        if importlib.util.find_spec(engine_cls.module) is None:
            print(f"{name}: not installed, skipped")
            continue
        print(f"{name}, {run(engine_cls, tokenizer, args.batch, args.steps)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
