"""bench/gpu_int8.py runs end to end at toy sizes on the CPU (Triton interpreter), so it cannot rot
between the occasions a GPU is available; its correctness checks must pass."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_int8_bench_smoke_run():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "bench/gpu_int8.py", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [line for line in result.stdout.splitlines() if line.startswith("check ")]
    assert len(checks) == 8 and all(line.endswith(" ok") for line in checks), result.stdout
