"""Run a training file on every rank: a torchrun-style script's ``__main__`` or one function.

The file runs inside its project directory (see ``clusterkit.runners.workdir``): in place or
in the synced copy, so sibling imports, files next to ``__file__``, ``sys.argv`` and snapshots
in the working directory behave as under torchrun. Without a project the file's text alone is
written to a private temporary directory on each rank.
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

    from clusterkit.runners.ddp.output import Printer
    from clusterkit.runners.ddp.progress import Progress
    from clusterkit.runners.workdir import Project

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


def _script_path(source: str | None, relative: str) -> tuple[str, str | None]:
    """The script's path on this rank: inside the project (cwd), else a private temp copy."""
    if source is None:
        return os.path.join(os.getcwd(), relative), None
    directory = tempfile.mkdtemp(prefix="clusterkit-train-")
    path = os.path.join(directory, relative)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(source)
    return path, directory


def _run_path(ctx: Any, source: str | None, relative: str, argv: list[str], run_name: str) -> Any:
    path, temporary = _script_path(source, relative)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))  # as `python path` and torchrun do
    try:
        return runpy.run_path(path, run_name=run_name)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def run_script_main(ctx: Any, source: str | None, relative: str, argv: list[str]) -> None:
    """Rank side: run the script as ``__main__`` with ``sys.argv = [file, *argv]``.

    ``source`` None: the script is ``relative`` inside the project (the rank's cwd).
    """
    _run_path(ctx, source, relative, argv, "__main__")


def run_script_function(
    ctx: Any, source: str | None, relative: str, function: str, argv: list[str]
) -> Any:
    """Rank side: load the file as a module and return ``function(ctx, *argv)``."""
    namespace = _run_path(ctx, source, relative, argv, "__clusterkit_train__")
    return namespace[function](ctx, *argv)


def run_file(
    target: str | Target,
    argv: list[str] | None = None,
    *,
    client: Client | None = None,
    world_size: int | None = None,
    max_restarts: int = 0,
    timeout: float | None = None,
    backend: str = "auto",
    workdir: str | os.PathLike[str] | Project | None = "auto",
    checkpoint_dir: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    stream_output: bool | Printer = True,
) -> list[Any]:
    """Run ``FILE.py`` (its ``__main__``, torchrun-style) or ``FILE.py:FUNC`` on every rank.

    A script brings its own ``init_process_group("env://")``; a function is called as
    ``FUNC(ctx, *argv)`` inside a group the runner set up, like :func:`ddp.run`'s ``train_fn``.
    ``workdir``: the project the script runs in (``"auto"``: the script's directory); None
    ships the file alone into a temporary directory. ``on_progress``, ``stream_output``: as
    :func:`ddp.run`'s (a script reports with ``from clusterkit.runners.ddp import report``);
    ``stream_output`` may also be the :class:`~.output.Printer` that shows the lines.
    """
    from clusterkit.runners.ddp.driver import RunOptions, run_group
    from clusterkit.runners.ddp.output import printer_for

    loaded = load_target(target) if isinstance(target, str) else target
    project = project_for(loaded, workdir)
    source: str | None = loaded.source
    relative = loaded.path.name
    if project is not None:
        source, relative = None, os.path.relpath(loaded.path, project.root)
    args = list(argv or [])
    fn: Callable[..., Any]
    fn_args: tuple[Any, ...]
    if loaded.function is None:
        fn, fn_args = run_script_main, (source, relative, args)
    else:
        fn, fn_args = run_script_function, (source, relative, loaded.function, args)
    options = RunOptions(
        world_size,
        backend,
        max_restarts,
        timeout,
        init_group=loaded.function is not None,
        project=project,
        checkpoint_dir=checkpoint_dir,
        on_progress=on_progress,
        printer=printer_for(stream_output),
    )
    return run_group(fn, fn_args, {}, client, options)


def project_for(loaded: Target, workdir: str | os.PathLike[str] | Project | None) -> Any:
    """The project a training file runs in; BadInput when the file is outside it."""
    from clusterkit.runners import workdir as project_dir

    if workdir is not None and str(workdir) == project_dir.AUTO:
        workdir = loaded.path.parent
    project = project_dir.resolve(workdir)
    if project is not None and Path(project.root) not in loaded.path.parents:
        raise BadInput(
            f"{loaded.path} is not inside the workdir {project.root}",
            hint="pass --workdir DIR holding the script, or --no-workdir",
        )
    return project
