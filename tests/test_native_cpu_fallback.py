"""The fallback kernels, whole models: with QRT_NATIVE_CPU=0 (as on a CPU without AVX-512 BF16 or
a compiler), the compiled format-contract cases whose layers qrt's own kernels would run (fp8 per
token, per block and static; int4 and int8 packs) run ATen's and the widened-fp8 kernels instead,
equal to eager, in one graph per role, with no recompiles. A process of its own, because whether
the kernels load is settled once per process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = ["online:fp8", "stored:fp8", "compressed-tensors:float-quantized", "stored:modelopt", "online:int4",
         "online:int8"]
TIMEOUT_S = 900


@pytest.mark.slow  # six compiled models in a process of their own
def test_compiled_models_on_the_fallback_kernels():
    tests = Path(__file__).parent
    selected = " or ".join(f"[{name}]" for name in CASES)
    env = {**os.environ, "QRT_NATIVE_CPU": "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", str(tests / "test_format_contract.py"), "-q", "-p",
                           "no:cacheprovider", "-m", "not bench", "-k",
                           f"test_compiled_equals_eager and ({selected})"],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tests.parent)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"{len(CASES)} passed" in done.stdout, done.stdout[-2000:]
