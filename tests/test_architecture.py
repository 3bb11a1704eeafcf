"""The package layers of docs/architecture.md hold: imports only flow down, no cycles, no
function-local imports of jaxmp modules outside ``cli/`` and the lazy top-level facade.

The layer table is read from docs/architecture.md itself, so the picture and the check cannot
drift apart. The import graph is built from the source (AST), not by importing anything.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxmp"
DOC = ROOT / "docs" / "architecture.md"
LOCAL_IMPORTS_ALLOWED = ("jaxmp", "jaxmp.cli")  # the lazy facade, and the CLI's late imports


def layer_table(text: str) -> dict[str, int]:
    """``{top-level package or module: layer}`` from the doc's "| layer | packages |" table."""
    out: dict[str, int] = {}
    for m in re.finditer(r"^\|\s*(\d+)\s*\|([^|]*)\|", text, re.M):
        for name in re.findall(r"`([\w]+)/?`", m.group(2)):
            out[name] = int(m.group(1))
    return out


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, module: str, mods: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported jaxmp module, line, inside a function?) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = [f"{child.module}.{a.name}" for a in child.names] + [child.module]
            for n in names:
                target = _resolve(n, mods) if n.startswith("jaxmp") else None
                if target and target != module and not module.startswith(target + "."):
                    found.append((target, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def top(module: str) -> str:
    return module.split(".")[1] if "." in module else module


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = modules()
    return {m: imports(p, m, mods) for m, p in mods.items()}


def test_every_package_has_a_layer():
    layers = layer_table(DOC.read_text())
    assert layers, "docs/architecture.md has no layer table"
    missing = sorted({top(m) for m in modules() if m != "jaxmp"} - set(layers))
    assert not missing, f"packages missing from the layer table in docs/architecture.md: {missing}"


def test_imports_flow_down(graph):
    layers = layer_table(DOC.read_text())
    upward = sorted({f"{m} (layer {layers[top(m)]}) imports {t} (layer {layers[top(t)]}) at "
                     f"line {line}" for m, edges in graph.items() if m != "jaxmp"
                     for t, line, _ in edges if t != "jaxmp" and layers[top(t)] > layers[top(m)]})
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_function_local_jaxmp_imports(graph):
    local = sorted({f"{m}:{line} imports {t} inside a function" for m, edges in graph.items()
                    if not m.startswith(LOCAL_IMPORTS_ALLOWED[1]) and m != LOCAL_IMPORTS_ALLOWED[0]
                    for t, line, inside in edges if inside})
    assert not local, "\n".join(local)


def test_no_import_cycles(graph):
    edges = {m: {t for t, _, _ in e} for m, e in graph.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_config_and_cli_parser_import_no_jax():
    code = ("import sys, jaxmp, jaxmp.config, jaxmp.errors, jaxmp.recipes.gpt_config, "
            "jaxmp._util.env, jaxmp._util.fmt, jaxmp._util.io, jaxmp.cli; "
            "jaxmp.cli.build_parser(); print('jax' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", "importing the config or the CLI parser imported jax"


def test_the_checker_catches_an_upward_import(tmp_path):
    """The rules above are not vacuous: an upward import in a model file is seen as one."""
    mods = modules()
    fake = tmp_path / "gpt.py"
    fake.write_text("from jaxmp.train import Trainer\n\ndef f():\n    import jaxmp.plan\n")
    found = imports(fake, "jaxmp.models.gpt", mods)
    layers = layer_table(DOC.read_text())
    assert ("jaxmp.train", 1, False) in found and ("jaxmp.plan", 4, True) in found
    assert layers["train"] > layers["models"]
