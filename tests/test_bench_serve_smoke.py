"""bench/serve_load.py end to end on the tiny chat Llama: a real server, two levels, a short soak
with abandoned, structured, log-probability and long requests, the levels again without prefix caching, the table and the JSON. Tiny sizes measure nothing; the test checks that
every figure is there, nothing failed, and the soak left every slot free."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench  # about a minute: `make test-bench`, which CI runs after `make test`
def test_serve_load_smoke_run(chat_llama_dir, tmp_path):
    report_path = tmp_path / "serve_load.json"
    result = subprocess.run([sys.executable, "-m", "bench.serve_load", str(chat_llama_dir), "--levels", "1,2",
                             "--duration", "3", "--prompt-tokens", "8,40", "--max-tokens", "12", "--max-batch", "2",
                             "--max-seq-len", "256", "--soak", "8", "--soak-clients", "3", "--cancel-rate", "0.3",
                             "--soak-warmup", "2", "--soak-long-tokens", "40",
                             "--no-peer", "--shared-prefix", "8", "--compare-prefix-caching",
                             "--json", str(report_path), "--chart", str(tmp_path / "load.png")],
                            cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "output tok/s" in result.stdout and "soak:" in result.stdout, result.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no chart: matplotlib is not installed" in result.stdout
    report = json.loads(report_path.read_text())
    assert [(row["engine"], row["clients"]) for row in report["levels"]] == [
        ("qrt", 1), ("qrt", 2), ("qrt, no prefix caching", 1), ("qrt, no prefix caching", 2)]
    assert report["prompt_tokens"] > 0 and "prefix caching:" in result.stdout
    for row in report["levels"]:
        assert row["failures"] == 0 and row["requests"] >= 1 and row["output_tok_s"] > 0, row
        assert row["ttft_p50_s"] > 0 and row["itl_p50_s"] > 0 and row["tpot_p50_s"] > 0
    soak = report["soak"]
    assert soak["failures"] == 0 and soak["abandoned"] >= 1, soak
    assert soak["active_slots_after"] == 0 and soak["queue_depth_after"] == 0
    assert soak["warmup_failures"] == 0 and sum(kind["requests"] for kind in soak["kinds"].values()) >= 4, soak
    assert soak["rss_after_warmup_mib"] > 50 and soak["rss_end_mib"] > 50, soak  # the server's group, read
    assert "soak resident memory of the server" in result.stdout
    assert report["qrt_exit_code_after_sigterm"] == 0
    assert "llama.cpp skipped (--no-peer)" in report["notes"]


@pytest.mark.bench
def test_serve_load_smoke_run_with_replicas_and_a_shared_prefix(chat_llama_dir, tmp_path):
    report_path = tmp_path / "serve_load.json"
    # A 40-token shared prefix (160 characters of text; the tiny tokenizer's tokens are bytes) is
    # longer than the 100 characters the front routes by: every request after each replica's first hits.
    result = subprocess.run([sys.executable, "-m", "bench.serve_load", str(chat_llama_dir), "--replicas", "2",
                             "--affinity-prefix-chars", "100", "--threads", "2", "--levels", "1,2", "--duration", "3",
                             "--prompt-tokens", "8,40", "--max-tokens", "8", "--max-batch", "2", "--max-seq-len", "512",
                             "--soak", "0", "--no-peer", "--shared-prefix", "40", "--json", str(report_path)],
                            cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    for row in report["levels"]:
        assert row["failures"] == 0 and row["requests"] >= 1, row
    routing = report["routing"]
    assert routing["affinity_hit_rate"] > 0.5 and routing["restarts"] == 0, routing
    assert sum(routing["requests_per_replica"]) == routing["affinity_hits"] + routing["affinity_misses"]
    assert "affinity hit rate" in result.stdout and report["qrt_exit_code_after_sigterm"] == 0
