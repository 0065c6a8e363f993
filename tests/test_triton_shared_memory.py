"""Every tile configuration of every Triton GEMM (and decode attention) fits a Hopper SM's shared
memory: the kernels compiled for sm_90 by Triton's own compiler, without a GPU
(tests/helpers/hopper_shared_memory.py, in a process of its own because this one runs Triton's
interpreter). On an H200 the W4A16 and W4A8 kernels once asked for 245-442 KiB and failed to launch,
which the interpreter cannot show."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "hopper_shared_memory.py"
# A Hopper SM's largest shared-memory allocation for one block: 227 KiB (what Triton reported as
# the hardware limit on the H200).
HOPPER_SHARED_BYTES = 232448


@pytest.mark.slow  # a minute of Triton compiles for sm_90; the quick loop's Triton checks run the interpreter
def test_every_triton_gemm_tile_fits_a_hopper_sms_shared_memory():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = json.loads(run.stdout.splitlines()[-1])
    # 3 M ranges x (2 int + 2 lut4 + fp8 + block fp8 + int8 + W4A8) + 4 experts + 2 decode attention
    assert len(sizes) == 30, sorted(sizes)
    too_big = {name: size for name, size in sizes.items() if size > HOPPER_SHARED_BYTES}
    assert not too_big, too_big
