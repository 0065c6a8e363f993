"""Where qrt's start-up time goes: the phases of a cold start (empty Inductor cache) and of a warm
start (a second process on the cache the first one filled), each in a process of its own.

    python -m bench.profiles.profile_compile                  # the default model, bf16
    python -m bench.profiles.profile_compile PATH --quant int4

Phases come from torch's own compile timers (`torch._dynamo.utils.compilation_time_metrics`,
which nest: each row here is a timer minus the timers inside it), summed over the prefill and
decode graphs, plus a timer this script puts around Inductor's `freeze`:
- load: `compile_model(..., warmup=False)`: read, quantize or repack the weights;
- Dynamo: tracing the Python bytecode into a graph, and building guards;
- qrt passes + backend: the backend's own work before AOTAutograd (qrt's FX passes);
- AOTAutograd: functionalizing and lowering to ATen, without the freeze inside it;
- freeze: Inductor's freezing (weights become constants, oneDNN prepacking, constant folding);
- Inductor lowering: FX graph to Inductor IR, without autotuning;
- autotune: timing GEMM choices (decode only, when autotuning is on);
- Inductor codegen: scheduling, fusion and writing the C++ and Python code;
- C++ compile + load: compiling the generated kernels (or loading them from the cache);
- other: the rest of warmup()'s wall time (the first run of each graph, cache lookups).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from bench.measure import machine_state, print_machine_state
from bench.quants import QUANTS

PHASES = ("load", "Dynamo", "qrt passes + backend", "AOTAutograd", "freeze", "Inductor lowering", "autotune",
          "Inductor codegen", "C++ compile + load", "other")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="checkpoint folder (default: the default model)")
    parser.add_argument("--quant", choices=list(QUANTS), default="bf16")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one start, JSON to stdout
    return parser.parse_args()


def timed_freeze() -> list[float]:
    """Wrap Inductor's freeze (imported by compile_fx at each call) to record its durations."""
    import torch._inductor.freezing as freezing

    durations: list[float] = []
    original = freezing.freeze

    def freeze(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - started)

    freezing.freeze = freeze
    return durations


def phases(timers: dict[str, float], freeze_s: float, load_s: float, warmup_s: float) -> dict[str, float]:
    """Non-overlapping phases from torch's nested timers (seconds summed over graphs)."""
    t = defaultdict(float, timers)
    autotune = sum(seconds for name, seconds in timers.items() if name.endswith("_template_autotuning"))
    codegen = t["GraphLowering.codegen"]
    out = {
        "load": load_s,
        "Dynamo": t["_compile.compile_inner"] - t["OutputGraph.call_user_compiler"],
        "qrt passes + backend": t["OutputGraph.call_user_compiler"] - t["create_aot_dispatcher_function"],
        "AOTAutograd": t["create_aot_dispatcher_function"] - t["compile_fx_inner"] - freeze_s,
        "freeze": freeze_s,
        "Inductor lowering": t["GraphLowering.run"] - autotune,
        "autotune": autotune,
        "Inductor codegen": codegen,
        "C++ compile + load": t["GraphLowering.compile_to_module"] - codegen,
    }
    out["other"] = load_s + warmup_s - sum(out.values())
    return out


def child(args) -> None:
    """One start in this process: load, warm up (compile both graphs), print the phases as JSON."""
    freezes = timed_freeze()
    from torch._dynamo.utils import compilation_time_metrics

    from qrt.runtime import compile_model

    started = time.perf_counter()
    model = compile_model(args.path, QUANTS[args.quant], warmup=False, progress=False)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    model.warmup()
    warmup_s = time.perf_counter() - started
    timers = {name: sum(durations) for name, durations in compilation_time_metrics.items()}
    print(json.dumps({"phases": phases(timers, sum(freezes), load_s, warmup_s),
                      "compile_seconds": model.compile_seconds, "start_s": load_s + warmup_s}))


def run_start(args, cache_dir: str) -> dict:
    command = [sys.executable, "-m", "bench.profiles.profile_compile", "--child", "--quant", args.quant]
    command += [args.path] if args.path else []
    done = subprocess.run(command, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a start failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    print_machine_state(machine_state())
    with tempfile.TemporaryDirectory(prefix="qrt-profile-compile-") as cache_dir:
        cold = run_start(args, cache_dir)
        warm = run_start(args, cache_dir)
    print(f"\nstart-up of {args.path or 'the default model'} ({args.quant}), seconds, prefill + decode graphs")
    print(f"{'phase':<24}{'cold':>9}{'warm':>9}")
    for phase in PHASES:
        print(f"{phase:<24}{cold['phases'][phase]:>9.1f}{warm['phases'][phase]:>9.1f}")
    print(f"{'total':<24}{cold['start_s']:>9.1f}{warm['start_s']:>9.1f}")
    for name, start in (("cold", cold), ("warm", warm)):
        roles = ", ".join(f"{role} {seconds:.1f} s" for role, seconds in start["compile_seconds"].items())
        print(f"{name} compile by graph: {roles}")


if __name__ == "__main__":
    main()
