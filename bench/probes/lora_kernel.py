"""qrt's LoRA kernel (`qrt_cpu::lora_add`) alone: µs per layer of the default model's four adapted
layers (q/k/v, o, gate/up, down at rank 16), by batch and by how many adapters the rows use.

    python -m bench.probes.lora_kernel                              # bf16, batch 1 and 8, 1 and 2 threads
    python -m bench.probes.lora_kernel --batches 1,4,8 --threads 2

Each call takes another layer's adapter stacks from a ring of --layers (30, the default model's
depth), so that the pairs come from memory as in a decode step. Rows use one adapter ("one") or
four in turn ("four"). Medians of --rounds rounds of --calls calls, after one untimed round.
"""

import argparse
import statistics
import time

import torch

from bench.measure import positive_int
from qrt.kernels import native_cpu

# SmolLM2-135M's adapted layers at rank 16: (K, W = rank x shards, N).
LAYERS = {"q/k/v": (576, 48, 960), "o": (576, 16, 576), "gate/up": (576, 32, 3072), "down": (1536, 16, 576)}
SLOTS = 5  # four adapters and slot 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--layers", type=positive_int, default=30)
    parser.add_argument("--calls", type=positive_int, default=1000)
    parser.add_argument("--rounds", type=positive_int, default=3)
    return parser.parse_args(argv)


def layer_us(k: int, width: int, n: int, rows: torch.Tensor, args) -> float:
    """Median µs of one qrt_cpu::lora_add call over a ring of layers' stacks."""
    ring = [(torch.randn(SLOTS, width, k, dtype=torch.bfloat16), torch.randn(SLOTS, width, n, dtype=torch.bfloat16))
            for _ in range(args.layers)]
    x = torch.randn(len(rows), 1, k, dtype=torch.bfloat16)  # [B, 1, K]: one decode token a row
    y = torch.randn(len(rows), 1, n, dtype=torch.bfloat16)

    def one_round() -> float:
        started = time.perf_counter()
        for i in range(args.calls):
            a, b = ring[i % len(ring)]
            torch.ops.qrt_cpu.lora_add(y, x, a, b, rows)
        return (time.perf_counter() - started) / args.calls * 1e6

    one_round()
    return statistics.median(one_round() for _ in range(args.rounds))


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = native_cpu.why_unavailable()
    if reason is not None:
        print(f"qrt's CPU kernels are not available here: {reason}")
        return 1
    print("threads  batch  adapters  " + "  ".join(f"{name:>8}" for name in LAYERS) + "  per layer µs")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for batch in (int(b) for b in args.batches.split(",")):
            for kind, rows in (("one", torch.ones(batch, dtype=torch.long)),
                               ("four", torch.arange(batch, dtype=torch.long) % 4 + 1)):
                if batch == 1 and kind == "four":
                    continue
                times = [layer_us(*shape, rows, args) for shape in LAYERS.values()]
                print(f"{threads:>7}  {batch:>5}  {kind:>8}  " + "  ".join(f"{t:8.1f}" for t in times)
                      + f"  {sum(times):12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
