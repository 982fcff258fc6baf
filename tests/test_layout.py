"""The package's shape: short modules and functions, no import cycles, one backend contract."""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from clusterkit.backends.base import PLAIN_ATTACH, Backend, get_backend
from clusterkit.registry import BUILTIN, profile_model

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


#: Imports that point up or close a circle, each still to be undone (none left: runs are
#: library objects since issue 39, a RunSpec the runs layer executes, no argv replayed
#: through the CLI).
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def declared_layers() -> list[list[str]]:
    """The layers as the package docstring lists them, from the top: ``1. ``cli``, ...``."""
    import clusterkit

    items = re.findall(r"^\d+\. (.*?):", clusterkit.__doc__ or "", re.MULTILINE | re.DOTALL)
    return [re.findall(r"``([\w.]+)``", names) for names in items]


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index of the module's layer (0 is the top); ``clusterkit`` is the package facade."""
    first = module.split(".")[1] if "." in module else "clusterkit"
    return next((i for i, names in enumerate(layers) if first in names), None)


def _outside_type_checking(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node``, skipping ``if TYPE_CHECKING:`` bodies (not run time)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield other
                yield from _outside_type_checking(other)
            continue
        yield child
        yield from _outside_type_checking(child)


@dataclass(frozen=True)
class Import:
    """One imported name: the module it comes from (a package module when the name is a
    submodule) and, for ``from M import name``, the name."""

    importer: str
    module: str
    name: str | None
    line: int


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import statement of the module, at module level and inside functions and
    methods alike, resolved to this package's modules where it names one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in _outside_type_checking(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.append(Import(name, sub, None, node.lineno))
                else:
                    found.append(Import(name, base, alias.name, node.lineno))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (any statement, TYPE_CHECKING aside)."""
    known = modules()
    return {
        name: {i.module for i in imports_of(name, path, known) if i.module in known} - {name}
        for name, path in known.items()
    }


def test_every_module_has_a_declared_layer() -> None:
    layers = declared_layers()
    assert len(layers) >= 8, layers
    assert [m for m in modules() if layer_of(m, layers) is None] == []


def test_every_import_points_down() -> None:
    """No module imports from a layer above its own (imports inside functions too)."""
    layers = declared_layers()
    up = []
    for importer, targets in import_graph().items():
        for target in sorted(targets):
            below, above = layer_of(importer, layers), layer_of(target, layers)
            if (importer, target) in KNOWN_EXCEPTIONS or below is None or above is None:
                continue  # unplaced modules fail test_every_module_has_a_declared_layer
            if above < below:
                up.append(f"{importer} -> {target}")
    assert up == []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycles() -> None:
    """No circle among modules, counting the imports inside functions."""
    graph = import_graph()
    for importer, target in KNOWN_EXCEPTIONS:
        graph[importer].discard(target)
    assert circles(graph) == []


def test_no_private_name_crosses_a_module_boundary() -> None:
    known = modules()
    private = [
        f"{i.importer}:{i.line} imports {i.name} from {i.module}"
        for name, path in known.items()
        for i in imports_of(name, path, known)
        if i.module.split(".")[0] == "clusterkit"
        and i.name is not None
        and i.name.startswith("_")
        and not i.name.startswith("__")
    ]
    assert private == []


def test_the_known_exceptions_are_still_there() -> None:
    """An exception that no import needs any more leaves the list."""
    graph = import_graph()
    assert [edge for edge in KNOWN_EXCEPTIONS if edge[1] not in graph[edge[0]]] == []


def test_the_runs_layer_registers_its_hooks_with_the_lower_layers() -> None:
    """The supervisor and ``down`` reach the runs layer only through these entry points
    (pyproject.toml): a stale install would leave lost runs unresumed."""
    from clusterkit import runs
    from clusterkit.lifecycle import hooks

    assert hooks.registered(hooks.WATCH) == (runs.resume_lost_on_cluster,)
    assert hooks.registered(hooks.BEFORE_DOWN) == (runs.stop_on_cluster,)


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
    assert profile_model(name) is backend.Profile  # the schema's model is the backend's
    literal = typing.get_type_hints(profile_model(name))["backend"]
    assert typing.get_args(literal) == (name,)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_plain_attach_lists_the_backends_that_keep_the_default_attach(name: str) -> None:
    """``attach`` skips importing the backends in PLAIN_ATTACH: none of them may override it."""
    keeps_default = type(get_backend(name)).attach is Backend.attach
    assert keeps_default == (name in PLAIN_ATTACH)
