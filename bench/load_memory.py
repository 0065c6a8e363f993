"""Peak resident memory while loading a checkpoint, against the size of the loaded model.

    python -m bench.load_memory                      # the default model: its GGUF as stored, bf16, online fp8
    python -m bench.load_memory PATH --quant stored,fp8

Each load runs in a fresh process: the figure is VmHWM (peak resident set) minus VmRSS after
imports, so it covers reading the weights, quantizing them, the loader pass and the tokenizer.
"""

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

PROBE = textwrap.dedent("""
    import json, sys
    from qrt import runtime

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # MiB

    before = status("VmRSS:")
    path = None if sys.argv[1] == "-" else sys.argv[1]
    model = runtime.compile_model(path, quant=sys.argv[2] or None, compile=False, progress=False,
                                  max_seq_len=16).model
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights once
    size = sum(p.numel() * p.element_size() for p in unique)
    print(json.dumps({"peak_mib": status("VmHWM:") - before, "model_mib": size / 2**20}))
""")


def measure_load(path, quant: str | None) -> dict:
    """{"peak_mib", "model_mib", "ratio"} for loading `path` (None: the default model)."""
    result = subprocess.run([sys.executable, "-c", PROBE, "-" if path is None else str(path), quant or ""],
                            capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    figures["ratio"] = figures["peak_mib"] / figures["model_mib"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", type=Path, help="checkpoint folder (default: the default model)")
    parser.add_argument("--quant", default="stored,none,fp8",
                        help="comma-separated: stored (as the file holds it), none (dequantized where the file is "
                             "quantized), an online format such as fp8")
    args = parser.parse_args()
    from qrt.runtime.default_model import gguf_path

    source = args.path or gguf_path()  # a file (a GGUF) is also measured against its size
    file_mib = source.stat().st_size / 2**20 if source.is_file() else None
    print(f"{'quant':<6} {'model MiB':>10} {'peak MiB':>10} {'peak/model':>11}" + (" peak/file" if file_mib else ""))
    for quant in args.quant.split(","):
        figures = measure_load(args.path, None if quant == "stored" else quant)
        print(f"{quant:<6} {figures['model_mib']:>10.0f} {figures['peak_mib']:>10.0f} {figures['ratio']:>11.2f}"
              + (f" {figures['peak_mib'] / file_mib:>9.2f}" if file_mib else ""))


if __name__ == "__main__":
    main()
