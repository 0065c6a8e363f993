"""Where a prompt's log-probabilities could lose precision, position by position: the same tokens
scored by transformers in float32 (the reference) and in bf16, by qrt's compiled forward called
directly, by qrt's engine (prefill in one chunk, and in chunks of 64 tokens), and by `qrt serve`
(echo + logprobs, as lm-eval's local-completions asks: one prompt per request, and four prompts
in one request).

    python -m bench.probes.prompt_scores                 # the default model's bf16 folder
    python -m bench.probes.prompt_scores PATH --tokens 300

For each path it prints the mean and worst |difference| from float32 over the scored positions,
and whether the served numbers are the in-process engine's bit for bit (then nothing between the
forward pass and the JSON loses precision)."""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench.measure import machine_state, print_machine_state, print_table
from bench.serve_load import ServerProcess, free_port

EVAL_TEXT = Path(__file__).resolve().parents[2] / "qrt" / "runtime" / "data" / "eval_text.txt"
BATCH = 4  # prompts in one request, as lm-eval sends them with batch_size 4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the default model, bf16)")
    parser.add_argument("--tokens", type=int, default=600, help="prompt tokens scored (default: 600)")
    parser.add_argument("--small-chunk", type=int, default=64, help="the engine's prefill chunk for the chunked row")
    return parser.parse_args(argv)


def next_token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """logits [T, V] of positions 0..T-1 -> the log-probability of each next token [T - 1]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)[:-1]
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def transformers_scores(path, ids: list[int], dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return next_token_logprobs(model(torch.tensor([ids])).logits[0], ids)


def engine_scores(model, ids: list[int], chunk: int) -> torch.Tensor:
    from qrt.runtime.engine import Engine
    from qrt.runtime.sampling import SamplingParams

    engine = Engine(model, chunk_size=chunk, prefix_caching=False)
    seq = engine.submit(model.request(ids, 0, SamplingParams(0.0), prompt_logprobs=0))
    engine.run([seq])
    return torch.tensor([scored.logprob for scored in seq.prompt_logprobs[1:]])  # the first token has none


def served_scores(path, requests: list[list[list[int]]]) -> list[list[torch.Tensor]]:
    """`qrt serve` on `path`, one request per item of `requests` (its prompts, token ids), each
    prompt's echoed scores as lm-eval reads them."""
    import httpx2 as httpx

    port = free_port()
    with tempfile.TemporaryDirectory() as logs, \
            ServerProcess([sys.executable, "-m", "qrt", "serve", str(path), "--port", str(port),
                           "--served-model-name", "scored"], port, "/health", Path(logs) / "server.log") as server:
        server.wait_ready(900)
        answers = []
        for prompts in requests:
            reply = httpx.post(f"{server.url}/v1/completions", timeout=600, json={
                "model": "scored", "prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "echo": True}).json()
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            # The echoed prompt's tokens (the first has no score), then the one generated token.
            answers.append([torch.tensor(choice["logprobs"]["token_logprobs"][1:len(prompt)], dtype=torch.float32)
                            for choice, prompt in zip(choices, prompts)])
        return answers


def main(argv=None) -> int:
    args = parse_args(argv)
    from qrt import runtime
    from qrt.runtime.default_model import default_model_path

    state = machine_state()
    print_machine_state(state)
    path = Path(args.model) if args.model else default_model_path()
    model = runtime.compile_model(path, max_seq_len=max(1024, 2 * args.tokens), progress=False)
    ids = model.encode(EVAL_TEXT.read_text())[:args.tokens]
    # The batch: four prompts of different lengths, cut from the same text.
    quarter = args.tokens // BATCH
    prompts = [ids[i * quarter: (i + 1) * quarter - i * (quarter // 8)] for i in range(BATCH)]
    reference = transformers_scores(path, ids, torch.float32)
    batch_reference = [transformers_scores(path, p, torch.float32) for p in prompts]
    with torch.no_grad():
        direct = next_token_logprobs(model(torch.tensor([ids]))[0], ids)
    whole = engine_scores(model, ids, chunk=len(ids))
    rows = {
        "transformers bf16": transformers_scores(path, ids, torch.bfloat16),
        "qrt forward, called directly": direct,
        "qrt engine, prompt in one chunk": whole,
        f"qrt engine, chunks of {args.small_chunk}": engine_scores(model, ids, chunk=args.small_chunk),
    }
    [served_alone], served_batch = served_scores(path, [[ids], prompts])
    batch_engine = [engine_scores(model, p, chunk=256) for p in prompts]
    table = []
    for name, scores in rows.items():
        gap = (scores - reference).abs()
        table.append((name, f"{gap.mean():.4f}", f"{gap.max():.4f}", "—"))
    gap = (served_alone - reference).abs()
    same = "yes" if torch.equal(served_alone, engine_scores(model, ids, chunk=256).to(torch.float32)) else "no"
    table.append(("qrt serve, one prompt a request", f"{gap.mean():.4f}", f"{gap.max():.4f}", same))
    gaps = torch.cat([(s - r).abs() for s, r in zip(served_batch, batch_reference)])
    same = "yes" if all(torch.equal(s, e.to(torch.float32)) for s, e in zip(served_batch, batch_engine)) else "no"
    table.append((f"qrt serve, {BATCH} prompts in a request", f"{gaps.mean():.4f}", f"{gaps.max():.4f}", same))
    print(f"{path.name}: {len(ids) - 1} positions scored; the batch: {BATCH} prompts of "
          f"{', '.join(str(len(p)) for p in prompts)} tokens")
    print_table(("scored by", "mean |Δ| from float32", "worst |Δ|", "served = in-process engine, bit for bit"),
                table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
