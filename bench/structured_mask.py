"""What structured output costs per decode step: the grammar engine's token mask for each of a
batch's rows, filled and applied to the row's logits, on the default model's vocabulary.

    python bench/structured_mask.py                  # batch 8, a JSON schema, 64 steps
    python bench/structured_mask.py --batch 1 --steps 128

Each row follows its own path through the schema (its logits are random, masked, then argmaxed
and consumed, as the engine does), so the masks differ from row to row and step to step. Reports
the median and 90th percentile of one step's masking for the whole batch, in µs.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch  # noqa: E402

from bench.measure import positive_int  # noqa: E402
from qrt.runtime import structured  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
                   "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                               "required": ["city"]}},
    "required": ["name", "age", "tags", "address"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--steps", type=positive_int, default=64)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from qrt.runtime.default_model import default_model_path

    folder = default_model_path(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    vocab = 49152  # the default model's logits
    started = time.perf_counter()
    grammar_tokenizer = structured.GrammarTokenizer(tokenizer, vocab, {tokenizer.eos_token_id})
    print(f"vocabulary prepared in {time.perf_counter() - started:.2f} s")
    grammar = structured.json_schema(SCHEMA)
    rows = [grammar_tokenizer.matcher(grammar) for _ in range(args.batch)]
    generator = torch.Generator().manual_seed(0)
    step_us = []
    for _ in range(args.steps):
        logits = torch.randn(args.batch, vocab, generator=generator)  # [B, V]
        started = time.perf_counter()
        masked = [row.masked(logits[b]) for b, row in enumerate(rows)]
        step_us.append((time.perf_counter() - started) * 1e6)
        for row, row_logits in zip(rows, masked):
            if not row.matcher.is_stopped():
                row.accept(int(row_logits.argmax()))
    step_us.sort()
    print(f"llguidance, batch {args.batch}: {statistics.median(step_us):.0f} µs per step "
          f"(p90 {step_us[int(0.9 * len(step_us))]:.0f}), {statistics.median(step_us) / args.batch:.0f} µs per row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
