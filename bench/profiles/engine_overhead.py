"""What the continuous-batching engine costs `generate` per decode step, in one run.

    python -m bench.profiles.engine_overhead                      # the default model, bf16, 1 slot
    python -m bench.profiles.engine_overhead PATH --quant int4 --slots 8 --steps 128 --runs 5

Both sides decode the same greedy tokens with the same compiled graphs, one process, alternating
runs: `raw` calls the decode graph directly in a loop (argmax, feed the token back); `generate` is
`CompiledModel.generate`, one request through the engine (admission, per-request sampling, stop
checks, the listener). With --slots > 1 both decode at B = slots with the other slots idle, as a
lone request on a server does. Reports the median time per step of each and their ratio.
"""

import argparse
import statistics
import sys
import time

import torch

from bench.measure import print_machine_state, machine_state
from qrt import runtime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--quant", default=None)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    print_machine_state(machine_state())
    model = runtime.compile_model(args.model, quant=args.quant, max_batch_size=args.slots, max_seq_len=512)
    prompt = list(range(100, 132))  # 32 tokens

    def raw() -> list[int]:
        logits = model.prefill(torch.tensor([prompt]))
        tokens = []
        for step in range(args.steps):
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if step < args.steps - 1:
                logits = model.decode(torch.tensor([[token]]), len(prompt) + step)
        return tokens

    def engine() -> list[int]:
        return model.generate(prompt, max_new_tokens=args.steps, stop_at_eos=False)

    if raw() != engine():
        print("ERROR: the engine and the raw loop decoded different tokens")
        return 1
    times = {"raw": [], "generate": []}
    for _ in range(args.runs):
        for name, fn in (("raw", raw), ("generate", engine)):
            started = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - started) / args.steps * 1000)
    raw_ms, gen_ms = statistics.median(times["raw"]), statistics.median(times["generate"])
    print(f"model {model.source}, quant {model.scheme.describe()}, {args.slots} slot(s), {args.steps} steps "
          f"after a 32-token prompt (prefill included), median of {args.runs} runs")
    print(f"raw decode loop: {raw_ms:.3f} ms/step   generate (engine): {gen_ms:.3f} ms/step   "
          f"ratio {gen_ms / raw_ms:.3f}   engine cost {1000 * (gen_ms - raw_ms):.0f} µs/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
