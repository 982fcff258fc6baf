"""Run a training file on every rank: a torchrun-style script's ``__main__`` or one function.

The file's source text is shipped with the task (workers need no shared disk) and written to a
private temporary directory on each rank before ``runpy`` runs it, so ``__file__`` and
``sys.argv`` look as they do under torchrun.
"""

from __future__ import annotations

import ast
import os
import re
import runpy
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput

if TYPE_CHECKING:
    from distributed import Client

_TARGET = re.compile(r"^(?P<path>.+?\.py)(?::(?P<func>[A-Za-z_][A-Za-z0-9_]*))?$")


@dataclass(frozen=True)
class Target:
    """A training file and, optionally, the function in it to call as ``func(ctx, *argv)``."""

    path: Path
    source: str
    function: str | None


def load_target(spec: str) -> Target:
    """Parse and check ``FILE.py[:FUNC]`` without running it (BadInput when it is wrong)."""
    match = _TARGET.match(spec)
    if not match:
        raise BadInput(f"train target must look like FILE.py or FILE.py:FUNC, got '{spec}'")
    path = Path(match["path"])
    if not path.is_file():
        raise BadInput(f"no such file: {path}")
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"cannot read {path}: {error}") from None
    except SyntaxError as error:
        raise BadInput(f"{path}:{error.lineno}: syntax error: {error.msg}") from None
    function = match["func"]
    if function is not None:
        defined = [
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        if function not in defined:
            known = ", ".join(defined) or "none"
            raise BadInput(f"{path} defines no function '{function}' (functions: {known})")
    return Target(path.resolve(), source, function)


def _materialize(source: str, filename: str) -> str:
    directory = tempfile.mkdtemp(prefix="clusterkit-train-")
    path = os.path.join(directory, filename)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(source)
    return path


def run_script_main(ctx: Any, source: str, filename: str, argv: list[str]) -> None:
    """Rank side: run the script as ``__main__`` with ``sys.argv = [file, *argv]``."""
    path = _materialize(source, filename)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def run_script_function(
    ctx: Any, source: str, filename: str, function: str, argv: list[str]
) -> Any:
    """Rank side: load the file as a module and return ``function(ctx, *argv)``."""
    path = _materialize(source, filename)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    try:
        namespace = runpy.run_path(path, run_name="__clusterkit_train__")
        return namespace[function](ctx, *argv)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def run_file(
    target: str | Target,
    argv: list[str] | None = None,
    *,
    client: Client | None = None,
    world_size: int | None = None,
    max_restarts: int = 0,
    timeout: float | None = None,
    backend: str = "auto",
) -> list[Any]:
    """Run ``FILE.py`` (its ``__main__``, torchrun-style) or ``FILE.py:FUNC`` on every rank.

    A script brings its own ``init_process_group("env://")``; a function is called as
    ``FUNC(ctx, *argv)`` inside a group the runner set up, like :func:`ddp.run`'s ``train_fn``.
    """
    from clusterkit.runners.ddp.driver import _run

    loaded = load_target(target) if isinstance(target, str) else target
    args = list(argv or [])
    name = loaded.path.name
    fn: Callable[..., Any]
    fn_args: tuple[Any, ...]
    if loaded.function is None:
        fn, fn_args, init = run_script_main, (loaded.source, name, args), False
    else:
        fn, fn_args = run_script_function, (loaded.source, name, loaded.function, args)
        init = True
    return _run(fn, fn_args, {}, client, world_size, backend, max_restarts, timeout, init)
