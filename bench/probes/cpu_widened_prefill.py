"""The default model's 512-token prompt (two chunks of 256) compiled twice in one process: once with
the dense GEMMs of many rows widened to float32 (kernels/widened_cpu.py, as qrt runs on a CPU
without bf16 arithmetic) and once with them in bf16, the runs alternating.

    python -m bench.probes.cpu_widened_prefill

On a CPU with bf16 arithmetic qrt does not widen; there this compares the two all the same.
Neither build reads or writes qrt's compile cache. A quiet machine please.
"""

import statistics
import time

import torch

from qrt import runtime
from qrt.kernels import widened_cpu
from qrt.runtime.default_model import default_model_path

PROMPT = [(i * 7919) % 40000 + 100 for i in range(512)]  # fixed pseudo-random ids
RUNS = 3


def main() -> None:
    models = {}
    for widened in (True, False):
        widened_cpu._CPU_LACKS_HALF_ARITHMETIC = widened  # read when the graphs are traced
        torch._dynamo.reset()
        models[widened] = runtime.compile_model(default_model_path(), max_seq_len=640, cache=False)
    times = {True: [], False: []}
    for _ in range(RUNS):
        for widened, model in models.items():
            start = time.perf_counter()
            model.prefill_chunk(PROMPT[:256], 0, 0)
            model.prefill_chunk(PROMPT[256:], 256, 0)
            times[widened].append(time.perf_counter() - start)
    print(f"{torch.get_num_threads()} threads; 512-token prefill, median of {RUNS}:")
    for widened, runs in times.items():
        median = statistics.median(runs)
        print(f"  {'widened to float32' if widened else 'bf16 GEMMs':20} {median:.3f} s  {512 / median:.0f} tok/s  "
              f"(runs {', '.join(f'{t:.3f}' for t in runs)})")
    print(f"  widened / bf16: {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")


if __name__ == "__main__":
    main()
