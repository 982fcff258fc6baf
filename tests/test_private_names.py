"""Every private name of a dependency that clusterkit uses is listed, with why, in
docs/reference/private-names.md; this scan of clusterkit/ keeps that list current both ways.

Found by ``ast``: imports of a dependency's private module or name (``from dask._x import``),
``<dependency name>._x`` where the name was bound by an import from a dependency, methods named
``_x`` in a subclass of a dependency's class (overriding a private method) and ``super()._x``,
``getattr(obj, "_x")``, and ``obj._x`` on any object but ``self``/``cls`` whose ``_x`` clusterkit
does not define itself (clusterkit's own private names, ``_clusterkit*`` marks it sets on others'
objects, and the stdlib's documented ``os._exit`` and namedtuple ``_replace`` are not counted).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clusterkit"
LIST = ROOT / "docs" / "reference" / "private-names.md"
PUBLIC_STDLIB = {"_exit", "_replace", "_asdict", "_fields", "_make"}
#: Private names a dependency and clusterkit both define: used on any object but ``self``, they
#: are the dependency's (``trial._suggest``: Optuna's Trial; clusterkit's own is a method).
SHARED = {"_suggest"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def own_names(trees: list[ast.Module]) -> set[str]:
    """The private names clusterkit defines: functions, methods, classes, attributes it sets."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if private(n)}


def dependency_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing from outside clusterkit (and outside the stdlib's
    ``__future__``)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and node.module
            and node.module.split(".")[0] not in ("clusterkit", "__future__")
        ):
            bound |= {a.asname or a.name for a in node.names}
    return bound


def _foreign_bases(cls: type | None) -> list[type]:
    """The classes above ``cls`` that clusterkit does not define (None: not importable)."""
    if cls is None:
        return []
    return [b for b in cls.__mro__[1:] if not b.__module__.startswith("clusterkit")]


def _overrides(node: ast.ClassDef, cls: type | None, deps: set[str]) -> set[str]:
    """Private methods of the class that a dependency's class above it defines too, and the
    private names it reaches through ``super()``: resolved on the imported class where it can
    be; a class made in a function is judged by its bases' names alone."""
    methods = {
        f.name
        for f in node.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(f.name)
    }
    supers = {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and private(n.attr)
        and isinstance(n.value, ast.Call)
        and ast.unparse(n.value.func) == "super"
    }
    if cls is not None and len(cls.__mro__) > 2:
        foreign = _foreign_bases(cls)
        return {name for name in methods | supers if any(name in vars(b) for b in foreign)}
    named = {ast.unparse(b).split(".")[0] for b in node.bases}
    return (methods if named & deps else set()) | supers  # a mixin: super() is the other base


def scan_module(tree: ast.Module, own: set[str], module: object = None) -> set[str]:
    """The private names of others that one module uses (``module``: the imported module, to
    resolve its classes' bases)."""
    found: set[str] = set()
    deps = dependency_names(tree)
    in_classes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            cls = getattr(module, node.name, None) if node in tree.body else None
            found |= _overrides(node, cls if isinstance(cls, type) else None, deps)
            in_classes |= {
                id(n)
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Call)
            }
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != "clusterkit":
                found |= {p for p in node.module.split(".") if private(p)}
                found |= {a.name for a in node.names if private(a.name)}
        elif isinstance(node, ast.Import):
            found |= {p for a in node.names for p in a.name.split(".") if private(p)}
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                on_dep = isinstance(node.args[0], ast.Name) and node.args[0].id in deps
                if isinstance(name, str) and private(name) and (on_dep or name not in own):
                    found.add(name)
        elif isinstance(node, ast.Attribute) and private(node.attr) and id(node) not in in_classes:
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            on_dep = isinstance(base, ast.Name) and base.id in deps
            if on_dep or node.attr not in own or node.attr in SHARED:
                found.add(node.attr)
    return {n for n in found if n not in PUBLIC_STDLIB and not n.startswith("_clusterkit")}


def used_private_names() -> dict[str, set[str]]:
    """Private name -> the modules (paths under clusterkit/) that use it."""
    import importlib

    paths = sorted(PACKAGE.rglob("*.py"))
    trees = [ast.parse(p.read_text()) for p in paths]
    own = own_names(trees)
    used: dict[str, set[str]] = {}
    for path, tree in zip(paths, trees, strict=True):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            module = importlib.import_module(name)
        except ImportError:  # an extra not installed: its classes judged by name
            module = None
        for name in scan_module(tree, own, module):
            used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return used


def listed_private_names() -> dict[str, str]:
    """Private name -> its row in the list (the table's first column holds `name`)."""
    rows = {}
    for line in LIST.read_text().splitlines():
        if match := re.match(r"^\|\s*`([^`]+)`\s*\|", line):
            rows[match[1]] = line
    return rows


def test_every_private_name_used_is_listed_and_every_listed_one_is_used() -> None:
    used, listed = used_private_names(), listed_private_names()
    missing = {name: sorted(where) for name, where in used.items() if name not in listed}
    assert missing == {}, "list these in docs/reference/private-names.md"
    assert sorted(set(listed) - set(used)) == [], "no longer used: take them off the list"


def test_each_row_names_the_modules_that_use_it_and_a_test() -> None:
    used, listed = used_private_names(), listed_private_names()
    for name, row in listed.items():
        for where in used.get(name, ()):
            assert where.removeprefix("clusterkit/") in row, (name, where)
        assert "tests/test_" in row, f"{name}: which test breaks first?"


def test_the_scan_finds_each_kind_of_use() -> None:
    """The scan itself: each pattern it claims to find, found in a made-up module."""
    source = """
from dask._task_spec import Task
import distributed._version
from distributed import SpecCluster
import optuna

class Mine(SpecCluster):
    async def _start(self):
        await super()._correct_state()

def f(trial, study):
    optuna._hidden
    getattr(study, "_loop_runner", None)
    return trial._trial_id, self_made._mine
"""
    tree = ast.parse(source)
    assert scan_module(tree, own={"_mine"}) == {
        "_task_spec", "_version", "_start", "_correct_state", "_hidden", "_loop_runner",
        "_trial_id",
    }
