"""qrt's decode attention kernel (`qrt_cpu::decode_attention`) by context length: µs per call and
the rate at which it reads its K and V, against the plain-torch reference op.

    python -m bench.probes.decode_attention                        # the default model's heads, bf16
    python -m bench.probes.decode_attention --heads 32,8,128 --contexts 512,2000,8000 --threads 2

One row of batch 1 attends over its first C cache entries. Each call takes another layer's cache
from a ring of --layers caches (30, the default model's depth), so that K and V come from memory
as in a decode step rather than from the core's cache; "in cache" repeats one layer's. Medians of
--rounds rounds over the ring, after one untimed round. The kernel is checked against the
reference op before it is timed.
"""

import argparse
import statistics
import time

import torch

from bench.measure import positive_int
from qrt.kernels import native_cpu


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (default: SmolLM2-135M)")
    parser.add_argument("--contexts", default="16,256,600,2000")
    parser.add_argument("--layers", type=positive_int, default=30)
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--threads", type=positive_int, default=2)
    return parser.parse_args(argv)


# One row in cache slot 0, its first entry at position 0: (slots [B], first [B]).
SLOTS, FIRST = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)


def per_call_us(op, q, caches, last, rounds: int) -> float:
    def one_round() -> float:
        started = time.perf_counter()
        for k, v in caches:
            op(q, k, v, SLOTS, FIRST, last, q.shape[-1] ** -0.5, 0.0, None, None)
        return (time.perf_counter() - started) / len(caches)

    one_round()
    return statistics.median(one_round() for _ in range(rounds)) * 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    reason = native_cpu.why_unavailable()
    if reason is not None:
        raise SystemExit(f"qrt's CPU kernels are not available here: {reason}")
    heads, kv_heads, head_dim = map(int, args.heads.split(","))
    contexts = [int(c) for c in args.contexts.split(",")]
    length = max(contexts)
    gen = torch.Generator().manual_seed(0)
    shape = (1, kv_heads, length, head_dim)  # [slots, KVH, S, hd]
    caches = [(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
              for _ in range(args.layers)]
    q = torch.randn(1, heads, head_dim, generator=gen).bfloat16()  # [B, H, hd]
    kernel, reference = torch.ops.qrt_cpu.decode_attention, torch.ops.qrt.decode_attention
    print(f"{heads} query heads over {kv_heads} KV heads, head_dim {head_dim}, bf16, batch 1, {args.threads} threads, "
          f"a ring of {args.layers} caches; µs per call (median of {args.rounds} rounds)")
    print(f"{'context':>8} {'K+V KB':>8} {'kernel':>8} {'GB/s':>6} {'in cache':>9} {'reference':>10}")
    for context in contexts:
        last = torch.tensor([context - 1])
        k, v = caches[0]
        expected = reference(q, k, v, SLOTS, FIRST, last, head_dim ** -0.5, 0.0, None, None)
        got = kernel(q, k, v, SLOTS, FIRST, last, head_dim ** -0.5, 0.0, None, None)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
        kv_bytes = 2 * kv_heads * context * head_dim * 2
        ring = per_call_us(kernel, q, caches, last, args.rounds)
        cached = per_call_us(kernel, q, caches[:1] * args.layers, last, args.rounds)
        plain = per_call_us(reference, q, caches[: max(1, args.layers // 10)], last, max(1, args.rounds // 2))
        print(f"{context:>8} {kv_bytes / 1e3:>8.0f} {ring:>8.1f} {kv_bytes / ring / 1e3:>6.1f} {cached:>9.1f} {plain:>10.1f}")


if __name__ == "__main__":
    main()
