"""Perplexity of every online quantization next to the unquantized model, on one checkpoint and one text.

    python -m bench.quality                     # the default model, the bundled text, every quant=
    python -m bench.quality PATH --text FILE --window 512 --quant none,fp8 --json out.json
    python -m bench.quality PATH --eager        # reference ops, no torch.compile (a quick check)

The rows are `none` (weights as stored, run in --dtype: "bf16" for the default model) and every
`quant=` name in the format registry's online formats, so a new online format gets a row with no change
here. Each row loads the checkpoint with runtime.compile_model and scores the same tokens of the
text with runtime.evaluate's sliding window (`qrt eval` computes the same figures); the ratio
column is each row's perplexity over the unquantized row's. Models are evaluated one at a time, each freed before the
next is loaded. Perplexity does not depend on the machine's load, only the seconds in the JSON do.
"""

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from qrt.formats.catalog import online_formats
from qrt.runtime.evaluate import DEFAULT_TEXT, DEFAULT_WINDOW, check_window, perplexity_of_text, read_text

DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def quant_names() -> list[str]:
    """Every row the suite knows: the unquantized model, then each online format."""
    return ["none", *online_formats()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="checkpoint folder (default: the default model)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text (default: the bundled one)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per forward pass")
    parser.add_argument("--stride", type=int, help="tokens each window moves on (default: window // 2)")
    parser.add_argument("--quant", type=parse_quants, default=quant_names(),
                        help=f"comma-separated rows (default: all of {','.join(quant_names())})")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_NAMES),
                        help="activation and unquantized-weight dtype of every row (default: bfloat16)")
    parser.add_argument("--eager", action="store_true", help="skip torch.compile (reference ops)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.stride = args.window // 2 if args.stride is None else args.stride
    try:
        check_window(args.window, args.stride)
    except ValueError as err:
        parser.error(str(err))
    return args


def parse_quants(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in quant_names()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {quant_names()}, got {text!r}")
    return names


def evaluate(path, quant: str, text: str, args) -> dict:
    from qrt.runtime import compile_model

    label = DTYPE_NAMES[args.dtype] if quant == "none" else quant
    print(f"{label}: loading and scoring …", file=sys.stderr, flush=True)
    # The full forward uses no KV cache: size it to the window rather than the default.
    model = compile_model(path, quant, dtype=args.dtype, max_seq_len=args.window,
                          compile=not args.eager, warmup=False, progress=False)
    result = perplexity_of_text(model, text, window=args.window, stride=args.stride)
    row = {"quant": quant, "label": label, "quantization": model.scheme.describe(), "model": str(model.source),
           **result.as_dict()}
    del model
    gc.collect()  # so the next model loads with only itself in memory
    return row


def markdown_table(rows: list[dict]) -> str:
    reference = next((row for row in rows if row["quant"] == "none"), None)
    ratio_header = "× ref" if reference is None else f"× {reference['label']}"
    lines = [f"| quantization | perplexity | {ratio_header} | bits per byte | scored tokens |", "|---|---|---|---|---|"]
    for row in rows:
        ratio = "—" if reference is None else f"{row['perplexity'] / reference['perplexity']:.4f}"
        lines.append(f"| {row['label']} | {row['perplexity']:.4f} | {ratio} | {row['bits_per_byte']:.4f} "
                     f"| {row['scored_tokens']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        text = read_text(args.text)
        rows = [evaluate(args.path, quant, text, args) for quant in args.quant]
    except ValueError as err:  # the checkpoint or text cannot be scored: say why, without a traceback
        print(f"quality: {err}", file=sys.stderr)
        return 2
    first = rows[0]
    print(f"model: {first['model']}; text: {args.text} ({first['text_bytes']} bytes, {first['tokens']} tokens); "
          f"window {args.window}, stride {args.stride}; {'eager' if args.eager else 'compiled'}")
    print(markdown_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"text": str(args.text), "window": args.window, "stride": args.stride, "dtype": args.dtype,
                  "compiled": not args.eager, "rows": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
