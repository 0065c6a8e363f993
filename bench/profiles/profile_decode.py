"""Where one decode step of a compiled qrt model spends its time: a torch.profiler table by kernel
kind, the time outside any kernel, and the step against this machine's bandwidth roofline.

    python -m bench.profiles.profile_decode                        # the default model, bf16
    python -m bench.profiles.profile_decode PATH --quant int4 --steps 64 --top 12

The model is compiled with Inductor's kernel profiling on (`cpp.enable_kernel_profile`), so every
generated C++ kernel is an event of its own; the compile uses a fresh temporary Inductor cache
(that flag changes the generated code). The step time is measured three times: without the
profiler (the figure that counts: the decode graph called directly, without Dynamo), through Dynamo
and its guards (what the direct call saves), and under the profiler (the events' sum is compared
against that one). "Outside any kernel" is the profiled step minus the events' self times: Python
in the generated wrapper, qrt's own call path, the decode loop, sampling. Two lines read the
profile against the step's bytes: attention's time against the K and V it reads at the bandwidth
measured in the same run, and the share of the step spent outside kernels (the Python wrapper plus
the time outside any event), under the profiler and without it (the unprofiled step minus the
kernels' profiled times: the profiler's own cost per event lands in the wrapper's time).

Kinds, from the event names:
- matmul: oneDNN/ATen linears and mm, Inductor's C++ GEMM templates, qrt's packed-integer ops;
- attention: scaled-dot-product attention;
- fused elementwise: Inductor's other generated kernels (norms, RoPE, SiLU·mul, KV-cache writes);
- wrapper (Python): the self time of the events torch.compile wraps a compiled graph in (Dynamo's
  cache lookup and guards, AOTAutograd's runtime wrapper, the generated Python wrapper);
- other ATen: every other ATen op (allocations, views, the argmax that picks each token).
Prefill runs before the profiler starts.
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from torch._inductor import config as inductor_config

from bench.measure import log, machine_state, positive_int, print_machine_state, prompt_ids
from bench.roofline import (cached_bandwidth, expert_weight_bytes, experts_read_fraction, kv_bytes_per_step,
                            roofline_tok_s, weight_bytes_per_token)
from bench.quants import QUANTS

MATMUL_MARKERS = ("linear", "mm", "gemm", "int4pack", "int8pack", "qrt::")
ATTENTION_MARKERS = ("scaled_dot_product", "attention", "sdpa")
WRAPPER_MARKERS = ("## call compiledfxgraph", "torch-compiled region", "torchdynamo cache lookup",
                   "aotdispatcher", "pregraph bytecode")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="checkpoint folder (default: the default model)")
    parser.add_argument("--quant", choices=list(QUANTS), default="bf16")
    parser.add_argument("--steps", type=positive_int, default=64, help="decode steps profiled")
    parser.add_argument("--prompt-tokens", type=positive_int, default=32)
    parser.add_argument("--top", type=positive_int, default=10, help="events listed by time")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's)")
    return parser.parse_args()


def kind_of(name: str) -> str:
    lowered = name.lower()
    if any(lowered.startswith(marker) for marker in WRAPPER_MARKERS):
        return "wrapper (Python)"
    if any(marker in lowered for marker in ATTENTION_MARKERS):
        return "attention"
    if any(marker in lowered for marker in MATMUL_MARKERS):
        return "matmul"
    if lowered.startswith("cpp_fused") or lowered.startswith("graph_"):
        return "fused elementwise"
    return "other ATen"


def decode_steps(model, ids: list[int], steps: int, around=contextlib.nullcontext) -> list[float]:
    """Prefill `ids`, then `steps` greedy decode steps inside `around()`; the seconds of each step."""
    logits = model.prefill(torch.tensor([ids]))  # [1, 1, vocab]
    seconds = []
    with around():
        for step in range(steps):
            started = time.perf_counter()
            token = logits[:, -1].argmax(-1)  # [1]
            logits = model.decode(token.view(1, 1), len(ids) + step)
            seconds.append(time.perf_counter() - started)
    return seconds


def self_times(averages) -> dict[str, float]:
    """Event name -> total self CPU time in seconds (events that call others count only their own)."""
    totals: dict[str, float] = defaultdict(float)
    for event in averages:
        if event.self_cpu_time_total > 0:
            totals[event.key] += event.self_cpu_time_total / 1e6
    return totals


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qrt-profile-inductor-"))
    state = machine_state()
    print_machine_state(state)
    from qrt.runtime import compile_model

    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        log(f"compiling ({args.quant})")
        model = compile_model(args.path, QUANTS[args.quant], progress=False)
        ids = prompt_ids(model.vocab_size, args.prompt_tokens)
        decode_steps(model, ids, 4)  # untimed: first calls of every kernel
        plain = statistics.median(decode_steps(model, ids, args.steps))
        # What calling the graph without Dynamo saves: the same steps through Dynamo and its
        # guards, as every decode step ran before qrt/runtime/direct_graph.py.
        guarded = statistics.median(decode_steps(model, ids, args.steps, model.guarded))
        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiled = sum(decode_steps(model, ids, args.steps, lambda: profile)) / args.steps
    if model.compile_report()["decode"] != 1:
        raise SystemExit(f"decode compiled into {model.compile_report()['decode']} graphs; expected 1")

    averages = profile.key_averages()  # one entry per event name
    events = {name: total / args.steps for name, total in self_times(averages).items()}
    by_kind: dict[str, float] = defaultdict(float)
    for name, seconds in events.items():
        by_kind[kind_of(name)] += seconds
    by_kind["outside any kernel"] = max(profiled - sum(events.values()), 0.0)

    bandwidth = cached_bandwidth(remeasure=True)["gb_s"]  # today's: this machine's speed varies by day
    weight_bytes = weight_bytes_per_token(model.model, getattr(model.model.model.embed_tokens, "weight", None))
    moe = model.model.config.moe
    if moe is not None:  # a step of one token reads top_k of the experts (bench/roofline.py)
        experts = expert_weight_bytes(model.model)
        weight_bytes = round(weight_bytes - experts + experts * experts_read_fraction(moe.num_experts, moe.top_k, 1))
    roofline = roofline_tok_s(bandwidth, weight_bytes, 1)
    print(f"\ndecode step: {plain * 1e3:.2f} ms without the profiler (median of {args.steps}), "
          f"{profiled * 1e3:.2f} ms under it: {1 / plain:.1f} tok/s")
    print(f"through Dynamo and its guards (CompiledModel.guarded): {guarded * 1e3:.2f} ms "
          f"(the direct call is {guarded / plain:.2f}× its speed)")
    print(f"roofline: {weight_bytes / 1e6:.1f} MB of weights per token at {bandwidth:.1f} GB/s = "
          f"{1e3 / roofline:.2f} ms ({roofline:.1f} tok/s); this step reaches {1 / (plain * roofline):.0%} of it")
    print("\nper step, under the profiler:")
    print(f"{'kind':<22}{'ms':>8}{'share':>8}")
    for kind, seconds in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"{kind:<22}{seconds * 1e3:>8.2f}{seconds / profiled:>8.0%}")
    attention = by_kind.get("attention", 0.0)
    # The profiled steps feed positions len(ids) .. len(ids) + steps - 1, each attending up to itself.
    attended = len(ids) + (args.steps + 1) / 2
    kv_bytes = kv_bytes_per_step(model.model, attended)
    print(f"\nattention: {attention * 1e3:.2f} ms a step for {kv_bytes / 1e6:.2f} MB of K and V (about {attended:.0f} "
          f"entries a layer), {attention / (kv_bytes / (bandwidth * 1e9)):.1f}× the time those bytes take at "
          f"{bandwidth:.1f} GB/s")
    outside = by_kind["outside any kernel"] + by_kind.get("wrapper (Python)", 0.0)
    print(f"outside kernels (the Python wrapper and the time outside any event): {outside * 1e3:.2f} ms, "
          f"{outside / profiled:.0%} of the profiled step")
    # The profiler's own cost per event (recording each op call) lands in its caller's self time,
    # the Python wrapper's, so the line above overstates what a step spends outside kernels. The
    # kernels' profiled times set against the unprofiled step bound it from the other side.
    kernels = profiled - outside
    print(f"outside kernels without the profiler (the unprofiled step minus the kernels' profiled times): "
          f"{max(plain - kernels, 0.0) * 1e3:.2f} ms, {max(plain - kernels, 0.0) / plain:.0%} of the step")
    matmul = by_kind.get("matmul", 0.0)
    print(f"\nmatmuls alone would run at {weight_bytes / max(matmul, 1e-9) / 1e9:.1f} GB/s of weights "
          f"(bandwidth {bandwidth:.1f})")
    print(f"\ntop {args.top} events, ms per step (calls per step):")
    counts = {event.key: event.count / args.steps for event in averages}
    for name, seconds in sorted(events.items(), key=lambda item: -item[1])[:args.top]:
        print(f"{seconds * 1e3:>8.3f}  ({counts[name]:>5.1f})  {kind_of(name):<18} {name[:90]}")


if __name__ == "__main__":
    main()
