"""Ways to run the bf16 GEMMs of one decode step on the CPU with weights that are graph inputs
(not frozen constants), timed over a whole model's worth of distinct weights, to justify the
regional build's choice of a oneDNN weight prepacked by the loader (kernels/onednn_cpu.py).

    python -m bench.probes.cpu_bf16_gemm_options              # the default model's shapes (30 layers, 49152 vocab)
    python -m bench.probes.cpu_bf16_gemm_options --layers 16 --hidden 2048 --intermediate 5632 --vocab 32000 --kv 512

One "step" runs every linear of every layer once at M = 1 (q/k/v, o, gate/up, down, then lm_head),
each layer with its own weights, so they stream from memory as in decode rather than sitting in
cache. Options: `F.linear` on the dense weight (what an unfrozen graph calls); oneDNN's linear on
a weight prepacked once (`torch.ops.mkldnn._linear_pointwise`, called directly); and the same
through `qrt::onednn_linear`, the opaque op a compiled graph calls (the cost of its Python
dispatch and side-table lookup). Each figure is the median of 7 rounds of --steps steps, in ms per
step, with the weights' read rate; rounds of the options alternate, on a quiet machine please.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from qrt.kernels.onednn_cpu import prepack_weight


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192, help="k (and v) projection width")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    h, i = args.hidden, args.intermediate
    shapes = [(h + 2 * args.kv, h), (h, h), (2 * i, h), (h, i)]  # [N, K] per layer
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=gen).mul_(0.02).to(torch.bfloat16)
             for _ in range(args.layers) for n, k in shapes] + \
        [torch.randn(args.vocab, h, generator=gen).mul_(0.02).to(torch.bfloat16)]
    inputs = {k: torch.randn(1, k, generator=gen).to(torch.bfloat16) for k in {h, i}}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in dense]
    carriers = [prepack_weight(w) for w in dense]
    step_bytes = sum(w.numel() * 2 for w in dense)

    options = {
        "F.linear, dense weight": lambda: [F.linear(inputs[w.shape[1]], w) for w in dense],
        "oneDNN, prepacked (direct)": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none",
                                                                                    [], "") for w, p in zip(dense, packed)],
        "qrt::onednn_linear (opaque op)": lambda: [torch.ops.qrt.onednn_linear(inputs[c.shape[1]], c, None)
                                                   for c in carriers],
    }
    rounds = {name: [] for name in options}
    with torch.no_grad():
        for name, run in options.items():  # warm-up
            run()
        for _ in range(args.rounds):
            for name, run in options.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    run()
                rounds[name].append((time.perf_counter() - started) / args.steps)
    print(f"torch threads {torch.get_num_threads()}; {len(dense)} weights, {step_bytes / 2**20:.0f} MiB per step")
    for name, times in rounds.items():
        ms = statistics.median(times) * 1e3
        print(f"  {name:<32} {ms:7.2f} ms/step  [{min(times) * 1e3:.2f}–{max(times) * 1e3:.2f}]  "
              f"{step_bytes / (ms / 1e3) / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
