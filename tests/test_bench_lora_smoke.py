"""bench/lora.py and bench/probes/lora_kernel.py run end to end on tiny inputs: the rows, the ratios
and the load time are there. Tiny sizes measure nothing; the tests check that the figures are."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint
from qrt.kernels import native_cpu

ROOT = Path(__file__).resolve().parents[1]


def run(*argv) -> str:
    result = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.bench  # two compiles of a tiny model, about 30 s
def test_lora_bench_smoke_run(tmp_path):
    checkpoint = tmp_path / "tiny-llama"
    make_checkpoint(checkpoint, "llama", dtype=torch.bfloat16, num_hidden_layers=2, max_position_embeddings=512)
    report = tmp_path / "lora.json"
    out = run("bench.lora", str(checkpoint), "--rank", "4", "--adapters", "2", "--batch", "2", "--runs", "1",
              "--rounds", "1", "--prompt-tokens", "8", "--new-tokens", "6", "--json", str(report))
    assert "LoRA model b2, 2 adapters / LoRA model b2, one adapter for all" in out, out
    assert re.search(r"loading a rank-4 adapter into the running model: median [\d.]+ s", out), out
    figures = json.loads(report.read_text())
    assert len(figures["rates"]) == 6 and all(rate[0] > 0 for rate in figures["rates"].values())
    assert len(figures["ratios"]) == 4 and len(figures["load_s"]) == 1


@pytest.mark.bench  # kernel calls only, a few seconds
def test_lora_kernel_probe_times_every_layer():
    if native_cpu.why_not_wanted() is not None:
        pytest.skip(native_cpu.why_not_wanted())
    out = run("bench.probes.lora_kernel", "--batches", "1,2", "--threads", "1", "--layers", "2", "--calls", "20",
              "--rounds", "1")
    rows = re.findall(r"^\s+1\s+(\d)\s+(one|four)(?:\s+[\d.]+){5}$", out, re.M)
    assert rows == [("1", "one"), ("2", "one"), ("2", "four")], out
