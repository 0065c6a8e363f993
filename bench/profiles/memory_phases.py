"""Where a process's resident memory goes, phase by phase: qrt (imports, load, compile, decode)
against transformers eager (imports, from_pretrained, generate), each in a fresh process.

    python -m bench.profiles.memory_phases                       # the default model: qrt bf16 and int4, transformers
    python -m bench.profiles.memory_phases PATH --quant bf16,fp8,int8 --new-tokens 128

After each phase the probe prints VmRSS (resident now) and VmHWM (the peak so far), in MiB. The
prompt is 32 fixed token ids; decode runs --new-tokens greedy steps. qrt compiles into an empty
QRT_CACHE_DIR (a cold start), with the converted default model linked in.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from bench.measure import name_list, positive_int
from bench.quants import QUANTS

_STATUS = textwrap.dedent("""
    import json, sys
    def phase(name):
        fields = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        mib = lambda key: int(fields[key].split()[0]) / 1024
        print(json.dumps({"phase": name, "rss": mib("VmRSS"), "peak": mib("VmHWM")}), flush=True)
    phase("python started")
    import torch
    torch.set_num_threads(2)
    phase("import torch")
""")

QRT_PROBE = _STATUS + textwrap.dedent("""
    from qrt import runtime
    phase("import qrt (transformers, Inductor, Triton)")
    path, quant, new_tokens = (None if sys.argv[1] == "-" else sys.argv[1]), sys.argv[2] or None, int(sys.argv[3])
    model = runtime.compile_model(path, quant=quant, warmup=False, progress=False, max_seq_len=32 + new_tokens + 1)
    phase("load (read, quantize, repack, KV cache)")
    model.warmup()
    phase("compile prefill + decode")
    model.generate(list(range(100, 132)), max_new_tokens=new_tokens, stop_at_eos=False)
    phase(f"prefill + {new_tokens} decode steps")
""")

HF_PROBE = _STATUS + textwrap.dedent("""
    import transformers
    phase("import transformers")
    path, new_tokens = sys.argv[1], int(sys.argv[3])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    phase("from_pretrained (bf16)")
    with torch.no_grad():
        ids = torch.arange(100, 132)[None]
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
    phase(f"prefill + {new_tokens} decode steps")
""")


def run_probe(probe: str, path, quant, new_tokens: int, env: dict) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", probe, "-" if path is None else str(path), quant or "",
                             str(new_tokens)], capture_output=True, text=True, env=env, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", type=Path, help="checkpoint folder (default: the default model)")
    parser.add_argument("--quant", type=name_list(QUANTS), default="bf16,int4")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    args = parser.parse_args()
    from bench.suite import isolated_qrt_cache
    from qrt.runtime.default_model import default_model_path

    path = args.path or default_model_path()
    with tempfile.TemporaryDirectory(prefix="qrt-memory-") as work:
        runs = {"transformers eager bf16": run_probe(HF_PROBE, path, None, args.new_tokens, dict(os.environ))}
        for name in args.quant:
            env = {**os.environ, **isolated_qrt_cache(Path(work) / name)}
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)
            runs[f"qrt {name}"] = run_probe(QRT_PROBE, path, QUANTS[name], args.new_tokens, env)
    for engine, phases in runs.items():
        print(engine)
        previous = 0.0
        for p in phases:
            print(f"  {p['phase']:<44} rss {p['rss']:7.0f} MiB ({p['rss'] - previous:+6.0f})  peak {p['peak']:7.0f} MiB")
            previous = p["rss"]


if __name__ == "__main__":
    main()
