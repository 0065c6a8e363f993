"""Dense GEMMs in the model dtype against the same product widened to float32 (weight conversion
included), on the CPU, by row count: the measurements behind MIN_ROWS_WIDENED
(kernels/widened_cpu.py). On a CPU without bf16 arithmetic ATen's bf16 and fp16 GEMMs take about
M times the time of one row; widened, the rows share the float32 GEMM's blocking.

    python -m bench.probes.cpu_widened_gemm                       # the default model's shapes, bf16
    python -m bench.probes.cpu_widened_gemm --dtype float16 --rows 1,16,256

Each figure is the median of --rounds calls in ms, the two ways alternating; a quiet machine please.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (N, K) of the default model's linears: q/k/v, o, gate/up, down, the output layer.
DEFAULT_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,12,16,32,64,256", help="comma-separated row counts M")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    return parser.parse_args()


def median_ms(run, rounds: int) -> float:
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {torch.get_num_threads()} threads; ms per call: model dtype / widened (ratio)")
    print("M".rjust(5) + "".join(f"{n}x{k}".rjust(26) for n, k in DEFAULT_SHAPES))
    for rows in map(int, args.rows.split(",")):
        cells = []
        for n, k in DEFAULT_SHAPES:
            x, weight = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)  # [M, K], [N, K]
            native = median_ms(lambda: F.linear(x, weight), args.rounds)
            widened = median_ms(lambda: F.linear(x.float(), weight.float()).to(dtype), args.rounds)
            cells.append(f"{native:.2f} / {widened:.2f} ({native / widened:.2f}x)")
        print(str(rows).rjust(5) + "".join(cell.rjust(26) for cell in cells))


if __name__ == "__main__":
    main()
