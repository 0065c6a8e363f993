"""qrt installs as one top-level package and coexists with Hugging Face's `kernels` package, which
transformers imports for hub kernels (the test extra installs it)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BOTH = """
import kernels, transformers
import torch
from qrt import runtime
import qrt.kernels
assert hasattr(kernels, "get_kernel"), kernels.__file__  # Hugging Face's, not qrt's
assert "site-packages" in kernels.__file__, kernels.__file__
assert hasattr(torch.ops.qrt, "fp8_linear") and callable(runtime.compile_model)
print(kernels.__file__, qrt.kernels.__file__)
"""


def _run(cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", _BOTH], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_hf_kernels_and_qrt_import_side_by_side(tmp_path):
    _run(tmp_path)


def test_the_checkout_root_shadows_nothing():
    """`python -m qrt` from the checkout puts its root on sys.path: nothing there may shadow an
    installed package."""
    out = _run(ROOT)
    assert str(ROOT / "qrt" / "kernels") in out


def test_wheel_has_one_top_level_package(tmp_path):
    # Built from a copy: setuptools leaves its build folders in the source tree.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "qrt", source / "qrt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("qrt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"qrt", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                      + ".dist-info"}
    for layer in ("runtime", "server", "checkpoint", "formats", "formats/compressed_tensors", "layers", "kernels",
                  "passes"):
        assert f"qrt/{layer}/__init__.py" in names
    assert "qrt/runtime/data/eval_text.txt" in names
