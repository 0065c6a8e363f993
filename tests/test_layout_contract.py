"""Kernels own their weight layouts (kernels/layouts.py): a format hands its weights to whichever
kernel `choose()` returns and never asks which layout it got, nor reaches into a device kernel's
module. Read from the source with `ast` and from the kernel declarations."""

import ast
import re
import sys
from pathlib import Path

import qrt
import qrt.formats.catalog  # noqa: F401  (every format, and through them every kernel, registered)
from qrt.kernels.choices import declared
from qrt.kernels.layouts import Layout, NamedLayout

ROOT = Path(qrt.__file__).resolve().parent
# What a format may import from qrt.kernels: the numerics every device shares (the reference ops
# and their neutral weight forms), the kernel table and the layout contract.
SHARED_KERNEL_MODULES = re.compile(r"qrt\.kernels(\.(\w+_reference|choices|layouts|exact_division))?$")


def kernel_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("qrt.kernels"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qrt.kernels"):
            found.add(node.module)
            if node.module == "qrt.kernels":
                found.update(f"qrt.kernels.{alias.name}" for alias in node.names)
    return found


def format_sources() -> list[Path]:
    return sorted((ROOT / "formats").rglob("*.py"))


def test_formats_import_only_the_shared_numerics_of_kernels():
    reached = {f"{path.relative_to(ROOT)}: {module}" for path in format_sources()
               for module in kernel_imports(path) if not SHARED_KERNEL_MODULES.match(module)}
    assert not reached, f"formats reaching into a device kernel's module: {sorted(reached)}"


def test_no_format_branches_on_the_layout_it_got():
    branching = re.compile(r"\.layout\s*[!=]=|layout\.name|isinstance\([^)]*Layout")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in format_sources()
             for number, line in enumerate(path.read_text().splitlines(), 1) if branching.search(line)]
    assert not found, found


def test_every_kernel_a_loader_pass_can_choose_packs_and_calls_its_own_layout():
    for kernel in declared().values():
        assert isinstance(kernel.layout, Layout), f"{kernel.op}: layout {kernel.layout!r} is not a Layout"
        chosen_for_weights = kernel.recorded_as == "kernel" and kernel.serves and "qrt.fused_experts" not in kernel.serves
        if chosen_for_weights:
            assert not isinstance(kernel.layout, NamedLayout), \
                f"{kernel.op} serves {kernel.serves} but its layout cannot pack weights"


def test_the_checks_above_see_a_format_that_branches_or_reaches_in(tmp_path, monkeypatch):
    planted = tmp_path / "formats" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("from qrt.kernels.int_cpu import pack_int4_for_cpu\n"
                       "def f(kernel):\n    return kernel.layout == 'int4pack'\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for check in (test_formats_import_only_the_shared_numerics_of_kernels, test_no_format_branches_on_the_layout_it_got):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} passed on a planted violation")
