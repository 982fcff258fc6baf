"""`clusterkit hpo FILE.py:FUNC`: an asynchronous Optuna search on a profile's cluster."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer


def _project(target: str, workdir: str | None, max_size: str | None) -> Any:
    """The objective's project, scanned now: too big or missing fails before anything starts."""
    from clusterkit.runners.workdir import parse_max_size, scan

    limit = parse_max_size("--workdir-max-size", max_size) if max_size else None
    if workdir is None:
        path = Path(target.rpartition(":")[0])
        if not path.is_file():
            return None  # load_objective names the missing file
        workdir = str(path.resolve().parent)
    return scan(workdir, max_size=limit)


@contextlib.contextmanager
def _on_path(directory: str | None) -> Iterator[None]:
    """The project first on ``sys.path`` while the driver loads the objective (sibling
    imports work as under ``python FILE.py``)."""
    if directory is None:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        sys.path.remove(directory)


def _check_numbers(
    trials: int, direction: str, gpus_per_trial: float, timeout: float | None
) -> None:
    from clusterkit.errors import BadInput

    if trials < 1:
        raise BadInput(f"--trials must be at least 1, got {trials}")
    if direction not in ("minimize", "maximize"):
        raise BadInput(f"--direction must be minimize or maximize, got {direction!r}")
    if gpus_per_trial < 0:
        raise BadInput(f"--gpus-per-trial must be 0 or more, got {gpus_per_trial:g}")
    if timeout is not None and timeout <= 0:
        raise BadInput(f"--timeout must be positive, got {timeout:g}")


def hpo(
    target: str = typer.Argument(..., metavar="FILE.py:FUNC", help="The Optuna objective."),
    profile: str = typer.Option(None, "--profile", "-p", help="Profile name or path."),
    trials: int = typer.Option(..., "--trials", "-n", help="Total finished trials to reach."),
    storage: str = typer.Option(
        None, "--storage", help="Database URL or journal file; default ./STUDY.optuna.log."
    ),
    study_name: str = typer.Option(None, "--study-name", help="Default: FILE-FUNC."),
    direction: str = typer.Option("minimize", "--direction", help="minimize or maximize."),
    gpus_per_trial: float = typer.Option(0, "--gpus-per-trial", help="GPU units per trial."),
    timeout: float = typer.Option(None, "--timeout", help="Seconds after which none starts."),
    out: str = typer.Option(None, "--out", help="Results folder; default ./STUDY-results."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress."),
    workdir: str = typer.Option(
        None, "--workdir", help="Project directory trials run in (default: the file's)."
    ),
    no_workdir: bool = typer.Option(False, "--no-workdir", help="Ship the objective alone."),
    workdir_max_size: str = typer.Option(
        None, "--workdir-max-size", help="Largest project to copy, e.g. 200MiB (100MiB)."
    ),
) -> None:
    """Search hyperparameters: every worker slot busy, resumable with the same storage."""
    _check_numbers(trials, direction, gpus_per_trial, timeout)

    from clusterkit.runners.hpo import inputs as hpo_inputs

    project = None if no_workdir else _project(target, workdir, workdir_max_size)
    with _on_path(project.root if project is not None else None):
        objective = hpo_inputs.load_objective(target)
    if profile is not None:  # an unknown profile fails here, before anything starts
        from clusterkit.profiles import load_profile

        load_profile(profile)
    name = study_name or hpo_inputs.default_study_name(objective)
    store = hpo_inputs.resolve_storage(storage, name)

    from clusterkit import console
    from clusterkit.client import get_client
    from clusterkit.runners.hpo import best_summary, run

    folder = out or f"{name}-results"
    client = get_client(profile)
    try:
        study = run(
            objective,
            n_trials=trials,
            client=client,
            storage=store,
            study_name=name,
            direction=direction,
            resources={"GPU": gpus_per_trial} if gpus_per_trial else None,
            timeout=timeout,
            progress=progress,
            out=folder,
            workdir=project,
        )
    finally:
        client.close()
    console.message(best_summary(study))
    console.message(f"results: {folder}/ (report.html, trials.csv, *.png)")


def register(app: typer.Typer) -> None:
    app.command()(hpo)
