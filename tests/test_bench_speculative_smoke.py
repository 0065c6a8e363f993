"""bench/speculative.py runs end to end on a tiny random chat Llama: the model compiled with a
verify graph (and an int8 draft), each workload decoded with and without speculation, the table and the JSON. Tiny
sizes measure nothing; the test checks that the figures are there and that both sides gave the
same tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint
from tiny_tokenizer import write_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench
def test_speculative_smoke_run(tmp_path):
    checkpoint = tmp_path / "tiny-chat-llama"
    make_checkpoint(checkpoint, "llama", dtype=torch.bfloat16, num_hidden_layers=2, max_position_embeddings=2048)
    write_tokenizer(checkpoint)
    report_path = tmp_path / "speculative.json"
    result = subprocess.run([sys.executable, "-m", "bench.speculative", str(checkpoint), "--quant", "bf16", "--k", "2",
                             "--methods", "ngram,draft", "--draft-quant", "int8", "--runs", "1", "--new-tokens", "12",
                             "--workloads", "passage,free", "--json", str(report_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "speculative tok/s" in result.stdout and "NO" not in result.stdout
    rows = json.loads(report_path.read_text())["results"]
    assert [(row["method"], row["workload"]) for row in rows] == [
        ("ngram", "passage"), ("ngram", "free"), ("draft", "passage"), ("draft", "free")]
    for row in rows:
        assert row["same_tokens"] is True
        assert row["plain"]["median"] > 0 and row["speculative"]["median"] > 0
