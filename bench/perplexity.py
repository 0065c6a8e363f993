"""qrt's perplexity against llama.cpp's on the same GGUF files, token ids and windows.

    python -m bench.perplexity                     # the default model's GGUF files, the eval text
    python -m bench.perplexity FILE.gguf [FILE ...] --window 512 --stride 256 --text FILE.txt

For each file, both engines score the same token ids (the text encoded by the file's tokenizer as
qrt reads it, as `qrt eval` encodes it) through the same sliding windows (`qrt eval`'s plan:
windows of --window tokens every --stride tokens, each token scored once, in the first window
that holds it and the token before it). qrt runs the file as stored, compiled, as `qrt eval`
does; llama.cpp (llama-cpp-python) evaluates each window from an empty cache with every
position's logits kept. Both engines' logits go through the same log-softmax (float32, sums in
float64: `qrt.runtime.evaluate.perplexity_of_ids`), so the figures differ only by the engines'
arithmetic. The target is agreement within 1%. A third column scores the same ids with the file's
weights dequantized into a float32 model run eagerly (qrt's reference ops, `quant="none"`): the
file's own model without either engine's rounding, so a gap between the engines shows which of
them is nearer to it. (llama.cpp multiplies quantized weights by activations quantized to 8 bits,
Q8_0 or Q8_K; qrt multiplies them by the bf16 activations.)

llama.cpp's own `llama-perplexity` tool scores differently (chunks of n_ctx tokens that do not
overlap, each with BOS in front, only their second half scored), so its figure on the same text
is not this one; this bench compares the engines, not the two tools' conventions.

The default files are the ones bench/suite.py runs (bench/tools/gguf_variants.py derives them from
the shipped Q4_1 with llama.cpp's quantizer on first use). Needs `make llama-cpp`.
"""

import argparse
from pathlib import Path

import numpy as np
import torch

from qrt.runtime.evaluate import DEFAULT_TEXT, DEFAULT_WINDOW, encode, perplexity_of_ids, read_text

TARGET = 0.01  # |qrt / llama.cpp - 1|


class LlamaCppLogits:
    """llama.cpp as `perplexity_of_ids`'s model: token ids [1, T] -> logits [1, T, vocab] (fp32),
    every call from an empty cache."""

    def __init__(self, path: Path, window: int, threads: int):
        from llama_cpp import Llama

        self.max_seq_len = window
        self.llm = Llama(model_path=str(path), n_ctx=window, n_batch=window, n_ubatch=window, n_threads=threads,
                         n_threads_batch=threads, logits_all=True, verbose=False)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = ids[0].tolist()
        self.llm.reset()  # the next eval drops every cached position: the window sees only itself
        self.llm.eval(tokens)
        return torch.from_numpy(np.array(self.llm.scores[:len(tokens)], dtype=np.float32))[None]


def compare_file(path: Path, text: str, window: int, stride: int, threads: int) -> dict:
    from qrt import runtime

    model = runtime.compile_model(path, progress=False, max_seq_len=window)
    ids, bos_added = encode(model.tokenizer, text)
    ours = perplexity_of_ids(model, ids, window=window, stride=stride)
    theirs = perplexity_of_ids(LlamaCppLogits(path, window, threads), ids, window=window, stride=stride)
    exact = runtime.compile_model(path, quant="none", dtype=torch.float32, compile=False, progress=False,
                                  max_seq_len=window)
    reference = perplexity_of_ids(exact, ids, window=window, stride=stride)
    return {"file": path.name, "tokens": ours.tokens, "windows": ours.windows, "bos_added": bos_added,
            "qrt": ours.perplexity, "llama.cpp": theirs.perplexity, "ratio": ours.perplexity / theirs.perplexity,
            "float32": reference.perplexity}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="GGUF files (default: the default model's)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text (default: qrt eval's)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--stride", type=int, default=None, help="default: window // 2, as qrt eval")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    if not args.files:
        from bench.tools.gguf_variants import default_model_ggufs

        args.files = default_model_ggufs()
    stride = args.window // 2 if args.stride is None else args.stride
    text = read_text(args.text)
    print(f"{args.text.name}: window {args.window}, stride {stride}, {args.threads} threads")
    print("| file | tokens | windows | qrt perplexity | llama.cpp perplexity | qrt / llama.cpp | within 1% "
          "| float32 dequantized | qrt / float32 | llama.cpp / float32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    missed = 0
    for path in args.files:
        row = compare_file(path, text, args.window, stride, args.threads)
        within = abs(row["ratio"] - 1) <= TARGET
        missed += not within
        print(f"| {row['file']} | {row['tokens']} | {row['windows']} | {row['qrt']:.4f} | {row['llama.cpp']:.4f} | "
              f"{row['ratio']:.5f} | {'yes' if within else 'NO'} | {row['float32']:.4f} | "
              f"{row['qrt'] / row['float32']:.5f} | {row['llama.cpp'] / row['float32']:.5f} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
