"""The package's shape: short modules and functions, no import cycles, one backend contract."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from clusterkit.backends.base import BUILTIN, PLAIN_ATTACH, Backend, get_backend, profile_model

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "clusterkit"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def test_no_module_over_the_limit() -> None:
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_over_the_limit() -> None:
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert long == []


def _top_level_imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of this package imported when ``name`` is imported (not TYPE_CHECKING ones)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def test_no_import_cycles() -> None:
    known = modules()
    graph = {name: _top_level_imports(name, path, known) for name, path in known.items()}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            cycles.append([*stack[stack.index(node) :], node])
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [], done)
    assert cycles == []


def test_hooks_are_called_not_looked_up() -> None:
    offenders = [
        f"{name}: {line.strip()}"
        for name, path in modules().items()
        for line in path.read_text().splitlines()
        if "getattr(backend" in line or "getattr(self.backend" in line
    ]
    assert offenders == []


def test_nothing_reads_proc_and_api_holds_verbs_only() -> None:
    assert [n for n, p in modules().items() if '"/proc' in p.read_text()] == []
    api = ast.parse(modules()["clusterkit.api"].read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(api)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert imported.isdisjoint({"subprocess", "socket", "select", "signal", "psutil"})


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_backend_is_paired_with_its_profile_model(name: str) -> None:
    backend = get_backend(name)
    assert isinstance(backend, Backend) and name == backend.NAME
    literal = typing.get_type_hints(profile_model(name))["backend"]
    assert typing.get_args(literal) == (name,)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_plain_attach_lists_the_backends_that_keep_the_default_attach(name: str) -> None:
    """``attach`` skips importing the backends in PLAIN_ATTACH: none of them may override it."""
    keeps_default = type(get_backend(name)).attach is Backend.attach
    assert keeps_default == (name in PLAIN_ATTACH)
