"""The front page cannot rot: every command in README.md's shell blocks is one that qrt, the
Makefile or a bench module accepts as written, every Python block compiles, and every link to
docs/ leads to a file. Commands that install packages or need a live server are listed below as
exceptions, each with where it is exercised instead."""

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from qrt.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# Commands that this test does not parse, and why.
EXCEPTIONS = {
    "pip": "installs packages: `make setup` runs the same steps on every CI run",
    "echo": "writes the torch pin that the pip line after it uses",
}


def shell_commands() -> list[str]:
    """Each command of the README's ```bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            # `a && b` is two commands
            command = []
            for word in words + ["&&"]:
                if word == "&&":
                    if command:
                        commands.append(command)
                    command = []
                else:
                    command.append(word)
    return [" ".join(shlex.quote(w) for w in c) for c in commands]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def test_the_readme_has_the_two_commands_and_stays_a_front_page():
    commands = shell_commands()
    assert "make demo" in commands and "make test" in commands
    assert len(README.splitlines()) <= 200, "the README is a front page: move details to docs/"


@pytest.mark.parametrize("command", shell_commands())
def test_every_shell_command_in_the_readme_is_accepted(command):
    words = shlex.split(command)
    if words[0] in EXCEPTIONS:
        return
    if words[0] == "make":
        unknown = set(words[1:]) - make_targets()
        assert not unknown, f"{command}: no such make target {unknown}"
        return
    if words[:3] == ["python", "-m", "qrt"] or words[0] == "qrt":
        argv = words[3:] if words[0] == "python" else words[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit:
            pytest.fail(f"{command}: qrt refuses these arguments (exit {exit.code})")
        return
    if words[:2] == ["python", "-m"] and words[2].startswith("bench."):
        # The bench module's own parser, in a process of its own (bench modules read sys.argv).
        probe = (f"import sys, importlib; m = importlib.import_module({words[2]!r}); "
                 f"sys.argv = [{words[2]!r}] + {words[3:]!r}; m.parse_args({words[3:]!r})")
        result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}"
        return
    pytest.fail(f"{command}: neither a qrt, make or bench command nor a listed exception; add it to EXCEPTIONS "
                f"with where it is exercised")


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_every_python_block_in_the_readme_compiles_and_names_real_options(index):
    source = python_blocks()[index]
    tree = ast.parse(source)  # a syntax error fails here
    from qrt import runtime

    import inspect

    accepted = set(inspect.signature(runtime.compile_model).parameters)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "compile_model":
            unknown = {k.arg for k in node.keywords} - accepted
            assert not unknown, f"compile_model has no keyword {unknown}"


def test_every_local_link_in_the_readme_leads_to_a_file():
    links = re.findall(r"\]\(((?:docs|tests|bench|qrt)/[^)#]+)", README)
    assert links, "the README links to docs/"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_qrt_formats_runs_as_the_readme_shows():
    result = subprocess.run([sys.executable, "-m", "qrt", "formats"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "gguf" in result.stdout and "awq" in result.stdout
