"""The import graph of qrt's modules has no cycle, each layer imports only the layers below it
(docs/architecture.md draws them), and tests and benches import no private name of qrt. Read from
the source with `ast`, every import statement counted, those inside functions too."""

import ast
from pathlib import Path

import qrt

ROOT = Path(qrt.__file__).resolve().parent
# A layer may import the layers after it in this list, never one before it.
LAYERS = ("cli", "server", "runtime", "passes", "checkpoint", "formats", "layers", "kernels", "errors")


def module_name(path: Path) -> str:
    parts = ["qrt", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """The qrt modules that `name`'s source imports (a `from P import m` of a submodule counts as m)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {target for target in found if target in known and target != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "qrt"


def test_no_module_imports_in_a_circle():
    graph = import_graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_each_layer_imports_only_the_layers_below_it():
    upward = []
    for module, targets in import_graph().items():
        here = layer_of(module)
        if here not in LAYERS:
            continue
        for target in targets:
            there = layer_of(target)
            if there in LAYERS and LAYERS.index(there) < LAYERS.index(here):
                upward.append(f"{module} imports {target}")
    assert not upward, "\n".join(sorted(upward))


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    # The two checks above on a made-up package, so that they cannot pass by seeing nothing.
    fake = tmp_path / "qrt"
    (fake / "layers").mkdir(parents=True)
    (fake / "formats").mkdir()
    for init in (fake, fake / "layers", fake / "formats"):
        (init / "__init__.py").write_text("")
    (fake / "layers" / "a.py").write_text("from qrt.formats import b\n")
    (fake / "formats" / "b.py").write_text("def f():\n    from ..layers import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    graph = import_graph()
    assert graph["qrt.layers.a"] == {"qrt.formats.b"} and graph["qrt.formats.b"] == {"qrt.layers.a"}
    try:
        test_no_module_imports_in_a_circle()
    except AssertionError as err:
        assert "qrt.layers.a -> qrt.formats.b -> qrt.layers.a" in str(err) or "qrt.formats.b -> qrt.layers.a" in str(err)
    else:
        raise AssertionError("the circle was not found")


def test_tests_and_benches_import_only_public_names_of_qrt():
    checkout = ROOT.parent
    private = []
    for folder in ("tests", "bench"):
        for path in sorted((checkout / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qrt"):
                    private += [f"{path.relative_to(checkout)}: {node.module}.{alias.name}"
                                for alias in node.names if alias.name.startswith("_")]
    assert not private, "\n".join(private)
