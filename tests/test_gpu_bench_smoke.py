"""bench/gpu.py runs end to end at toy sizes on the CPU (Triton interpreter), so it cannot rot
between the occasions a GPU is available: every Triton kernel's check must pass."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# fp8: GEMM alone, per-token, static, block; int: W4A16, W8A16; int8: W8A8, W4A8, fused norm.
KERNELS_CHECKED = 9
SMOKE_ROWS = 2  # M = 1 and 5 on one toy shape


def test_gpu_bench_smoke_run():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [line for line in result.stdout.splitlines() if line.startswith("check ")]
    assert len(checks) == KERNELS_CHECKED * SMOKE_ROWS, result.stdout
    assert all(line.endswith(" ok") for line in checks), result.stdout
    # Every timed row ran: none of qrt's kernels, nor torch's baselines on the CPU, failed there.
    assert " failed: " not in result.stdout, result.stdout
