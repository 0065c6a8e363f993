"""The GPU benchmark scripts run end to end at toy sizes on the CPU (Triton interpreter), so they
cannot rot between the occasions a GPU is available; their correctness checks must pass."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench/gpu_fp8.py", "bench/gpu_int.py"])
def test_gpu_bench_script_smoke_run(script):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, script, "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [line for line in result.stdout.splitlines() if line.startswith("check ")]
    assert checks and all(line.endswith(" ok") for line in checks), result.stdout
