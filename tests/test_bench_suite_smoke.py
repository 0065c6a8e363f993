"""`python -m bench.suite --smoke` runs end to end on a tiny random Llama: every engine's jobs in their own
processes, the JSON with every figure of every row, and the chart, so the suite cannot rot between
the occasions it is run in full."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.checkpoints.tiny import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ROW_FIELDS = {"engine", "format", "label", "load_s", "compile_s", "warm_start_s", "first_token_s", "warm_first_token_s",
              "process_first_token_s", "warm_process_first_token_s", "prefill_tok_s", "decode_tok_s",
              "peak_rss_mib", "weight_bytes_per_token", "expert_bytes", "weight_bytes_per_step", "vs_transformers",
              "roofline_fraction", "errors", "notes", "jobs"}


@pytest.mark.bench  # a minute of bench subprocesses: `make test-bench`, which CI runs after `make test`
def test_suite_smoke_run(tmp_path):
    checkpoint = tmp_path / "tiny-llama"
    make_checkpoint(checkpoint, "llama", dtype=torch.bfloat16, num_hidden_layers=1)  # 1 layer: compiles faster
    report_path, chart_path = tmp_path / "suite.json", tmp_path / "suite.png"
    env = {**os.environ, "QRT_CACHE_DIR": str(tmp_path / "qrt-cache")}  # the bandwidth cache stays in tmp_path
    result = subprocess.run([sys.executable, "-m", "bench.suite", "--model", str(checkpoint), "--smoke",
                             "--quant", "bf16", "--json", str(report_path), "--chart", str(chart_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

    report = json.loads(report_path.read_text())
    assert report["batches"] == [1, 2]
    assert report["bandwidth"]["gb_s"] > 0
    rows = {row["label"]: row for row in report["rows"]}
    assert set(rows) == {"qrt bf16", "transformers eager bf16"}
    # Four decode steps of a tiny model take about as long as timing noise: the figures must be
    # there, not meaningful (one slow prefill run can even make a decode figure negative).
    for label, row in rows.items():
        assert set(row) == ROW_FIELDS, label
        # A dense model's step reads every weight at every batch size.
        assert row["expert_bytes"] == 0 and row["weight_bytes_per_step"]["2"] == row["weight_bytes_per_token"], label
        assert row["errors"] == [], label
        assert row["load_s"] > 0 and row["prefill_tok_s"]["median"] > 0, label
        for batch in ("1", "2"):
            assert isinstance(row["decode_tok_s"][batch]["median"], float), (label, batch)
            assert isinstance(row["roofline_fraction"][batch], float), (label, batch)
            assert row["peak_rss_mib"][batch] > 100, (label, batch)  # torch alone is more
    qrt = rows["qrt bf16"]
    assert qrt["compile_s"] > 0 and qrt["warm_start_s"] > 0
    assert set(qrt["jobs"]) == {"batch 1", "batch 2", "warm start"}
    assert all(isinstance(qrt["vs_transformers"][batch], float) for batch in ("1", "2"))
    for job in ("batch 1", "batch 2"):  # one graph per role: the timed runs recompiled nothing
        assert all(count <= 1 for count in qrt["jobs"][job]["graphs"].values()), job
    # The same bf16 weights, whichever engine holds them (qrt fuses q/k/v and gate/up: same bytes).
    assert qrt["weight_bytes_per_token"] == rows["transformers eager bf16"]["weight_bytes_per_token"]
    skipped = {entry["engine"] for entry in report["skipped"]}
    assert "transformers-compile" in skipped
    assert "llama.cpp" in skipped  # llama.cpp has no GGUF of this checkpoint, installed or not

    if importlib.util.find_spec("matplotlib") is not None:
        assert chart_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no chart: matplotlib is not installed" in result.stdout


def test_a_moe_step_reads_the_experts_its_batch_picks():
    from bench.roofline import experts_read_fraction
    from bench.suite import step_weight_bytes

    assert experts_read_fraction(32, 6, 1) == 6 / 32
    assert experts_read_fraction(32, 6, 8) == pytest.approx(1 - (26 / 32) ** 8)
    row = {"weight_bytes_per_token": 1000, "expert_bytes": 640}
    assert step_weight_bytes(row, 1, (32, 6)) == 360 + 120
    assert step_weight_bytes(row, 1, None) == 1000
