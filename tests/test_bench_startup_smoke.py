"""bench/startup.py runs end to end on a tiny random Llama: both builds' cold, warm and batched
jobs in their own processes, the table and the JSON, so the start-up bench cannot rot between the
occasions it is run in full. Tiny sizes measure nothing; the test checks that the figures are
there and that the warm start was served by qrt's compile cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench  # a minute of bench subprocesses: `make test-bench`, which CI runs after `make test`
@pytest.mark.runs_first
def test_startup_smoke_run(tmp_path):
    checkpoint = tmp_path / "tiny-llama"
    make_checkpoint(checkpoint, "llama", dtype=torch.bfloat16, num_hidden_layers=2)
    report_path = tmp_path / "startup.json"
    env = {**os.environ, "QRT_CACHE_DIR": str(tmp_path / "qrt-cache")}
    result = subprocess.run([sys.executable, "-m", "bench.startup", "--model", str(checkpoint), "--quant", "bf16",
                             "--runs", "1", "--new-tokens", "4", "--prompt-tokens", "8", "--batch", "2",
                             "--no-depth", "--json", str(report_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout, result.stdout
    assert "cold first token s" in result.stdout and "× frozen" in result.stdout

    rows = {row["label"]: row for row in json.loads(report_path.read_text())["start"]}
    assert set(rows) == {"qrt bf16 (regional build)", "qrt bf16 (frozen build)", "transformers eager bf16"}
    regional, frozen = rows["qrt bf16 (regional build)"], rows["qrt bf16 (frozen build)"]
    assert regional["jobs"]["batch 1"]["cache_hit"] is False
    assert regional["jobs"]["warm start"]["cache_hit"] is True
    assert regional["first_token_s"] > 0 and regional["warm_first_token_s"] > 0
    # From the process's start the imports count too, so that figure is the larger one.
    assert regional["warm_process_first_token_s"] > regional["warm_first_token_s"]
    assert "warm start" not in frozen["jobs"]  # only with --frozen-warm
    for row in (regional, frozen):
        for batch in ("1", "2"):
            assert isinstance(row["decode_tok_s"][batch]["median"], float), (row["label"], batch)
        assert row["peak_rss_mib"]["1"] > 100
        assert all(isinstance(r, str) and r != "—" for r in (regional["vs_frozen"]["1"], regional["vs_frozen"]["2"]))
