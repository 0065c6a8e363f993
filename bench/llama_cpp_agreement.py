"""Greedy agreement of qrt with llama.cpp on the same GGUF files.

    python -m bench.llama_cpp_agreement                     # the default model's GGUF files
    python -m bench.llama_cpp_agreement FILE.gguf [FILE ...] --new-tokens 64

For each file, qrt (the file as stored, compiled: the kernels a user gets) and llama.cpp
(llama-cpp-python, its eval loop and the argmax of its logits) continue the same prompts greedily.
Both are fed the same token ids, from the file's tokenizer, so tokenization plays no part.

- identical: the share of continuations that are the same token for token;
- common prefix: the mean number of tokens before the two continuations first differ;
- teacher-forced: qrt scores llama.cpp's continuation in one forward pass, and the share of its
  positions where qrt's argmax is llama.cpp's token. Unlike the two above, one early divergence
  does not decide the rest;
- logits rel L2: qrt's logits against llama.cpp's at those positions (float32, L2 of the
  difference over L2 of llama.cpp's), the two runtimes' arithmetic apart.

The default files are the ones bench/suite.py runs (bench/tools/gguf_variants.py derives them from
the shipped Q4_1 with llama.cpp's quantizer on first use). Needs `make llama-cpp`.
"""

import argparse
from pathlib import Path

import numpy as np
import torch

from bench.agreement import PROMPTS

MAX_SEQ_LEN = 256


def llama_cpp_continuation(llm, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation of `prompt`, and its logits [new_tokens, V] fp32 at the
    positions that chose each token."""
    llm.reset()
    llm.eval(prompt)
    tokens, logits = [], []
    for _ in range(new_tokens):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)  # [V]
        logits.append(row)
        tokens.append(int(row.argmax()))
        llm.eval(tokens[-1:])
    return tokens, np.stack(logits)


def compare_file(path: Path, new_tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    from qrt import runtime

    model = runtime.compile_model(path, progress=False, max_seq_len=MAX_SEQ_LEN)
    llm = Llama(model_path=str(path), n_ctx=MAX_SEQ_LEN, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    identical, prefixes, forced, errors = 0, [], [], []
    for text in PROMPTS:
        prompt = model.encode(text)
        theirs, their_logits = llama_cpp_continuation(llm, prompt, new_tokens)
        ours = model.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False)
        identical += ours == theirs
        prefixes.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), new_tokens))
        with torch.no_grad():
            scored = model(torch.tensor([prompt + theirs]))[0, len(prompt) - 1:-1].float()  # [new_tokens, V]
        forced.append((scored.argmax(-1) == torch.tensor(theirs)).float().mean().item())
        reference = torch.from_numpy(their_logits)
        errors.append(((scored - reference).norm() / reference.norm()).item())
    return {"file": path.name, "identical": identical / len(PROMPTS), "prefix": float(np.mean(prefixes)),
            "forced": float(np.mean(forced)), "logits_rel_l2": float(np.mean(errors))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="GGUF files (default: the default model's)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if not args.files:
        from bench.tools.gguf_variants import default_model_ggufs

        args.files = default_model_ggufs()
    print(f"{len(PROMPTS)} prompts, {args.new_tokens} greedy tokens each, {args.threads} threads")
    print(f"{'file':<40} {'identical':>9} {'common prefix':>13} {'teacher-forced':>14} {'logits rel L2':>13}")
    for path in args.files:
        row = compare_file(path, args.new_tokens, args.threads)
        print(f"{row['file']:<40} {row['identical']:>9.0%} {row['prefix']:>13.1f} {row['forced']:>14.1%} "
              f"{row['logits_rel_l2']:>13.4f}", flush=True)


if __name__ == "__main__":
    main()
