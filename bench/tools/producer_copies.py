"""The bench's random-weight Llama (0.85B, bench/tools/random_llama.py) written in the 4-bit formats
people download, each by its own producer, for `bench.suite --stored`:

- nf4: transformers with bitsandbytes (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=True)`), saved with `save_pretrained`, as unsloth's -bnb-4bit repositories are;
- nvfp4: llm-compressor's `QuantizationModifier(scheme="NVFP4A16")` (compressed-tensors
  nvfp4-pack-quantized: E2M1 codes, an e4m3 scale per 16, a global scale per tensor);
- mxfp4: llm-compressor's `QuantizationModifier(scheme="MXFP4A16")` (compressed-tensors
  mxfp4-pack-quantized: E2M1 codes, an e8m0 exponent per 32).

lm_head stays in bf16 in all three (each producer's default or its ignore list). Each producer runs in
the virtualenv the producer kit makes for it (tests/producers/build.py: its pins, torch's CPU build),
in a process of its own; each copy is written once into qrt's cache (bench/llama-1b-random-<name>)
and reused.

    python -m bench.tools.producer_copies               # make the missing copies; print NAME=FOLDER,...
    python -m bench.tools.producer_copies nf4,mxfp4
"""

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.tools.random_llama import FOLDER, random_llama_path
from qrt.cache_dir import cache_root

PRODUCER_KIT = Path(__file__).resolve().parents[2] / "tests" / "producers"
MARKER = ".complete"
TIMEOUT_S = 1800  # quantizing 0.85B on two cores takes minutes; a hang must not stall the bench

BITSANDBYTES = """
import sys, torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=config, dtype=torch.bfloat16,
                                             device_map="cpu")
model.save_pretrained(sys.argv[2])
"""

LLM_COMPRESSOR = """
import sys, torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme=sys.argv[3], ignore=["lm_head"])])
model.save_pretrained(sys.argv[2], save_compressed=True)
"""

# name: (producer venv, script, extra argument)
COPIES = {
    "nf4": ("bitsandbytes", BITSANDBYTES, None),
    "nvfp4": ("llmcompressor", LLM_COMPRESSOR, "NVFP4A16"),
    "mxfp4": ("llmcompressor", LLM_COMPRESSOR, "MXFP4A16"),
}


def producer_python(venv: str) -> Path:
    """The python of the producer kit's venv for `venv`, made first if needed."""
    spec = importlib.util.spec_from_file_location("producer_kit_build", PRODUCER_KIT / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    logs = cache_root() / "bench" / "producer-logs"
    logs.mkdir(parents=True, exist_ok=True)
    return build.ensure_venv(venv, logs)


def copy_path(name: str) -> Path:
    """The folder of copy `name`, written first if absent."""
    final = cache_root() / "bench" / f"{FOLDER}-{name}"
    if (final / MARKER).is_file():
        return final
    venv, script, extra = COPIES[name]
    base = random_llama_path()
    python = producer_python(venv)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        print(f"writing the 0.85B Llama in {name} with the {venv} producer into {final} (first use only)",
              file=sys.stderr, flush=True)
        args = [str(python), "-c", script, str(base), str(tmp)] + ([extra] if extra else [])
        subprocess.run(args, check=True, timeout=TIMEOUT_S, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
        (tmp / MARKER).write_text(f"{venv} {extra or ''}\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def main(argv: list[str]) -> int:
    names = argv[0].split(",") if argv else list(COPIES)
    unknown = set(names) - set(COPIES)
    if unknown:
        raise SystemExit(f"unknown copies {sorted(unknown)}; known: {', '.join(COPIES)}")
    print(",".join(f"{name}={copy_path(name)}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
