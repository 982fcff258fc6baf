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


def cluster_is_up(name: str) -> bool:
    """Whether ``name`` is a cluster from `up` (attached to by name: no profile needed)."""
    from clusterkit import state

    if name.endswith((".yaml", ".yml")) or "/" in name:
        return False
    record = state.read_record(name)
    return record is not None and state.is_live(record)


def _check_numbers(
    trials: int, direction: str, gpus_per_trial: float, seconds: dict[str, Any], **counts: int
) -> None:
    """The numbers a search takes; ``seconds``: option names (``timeout``) and their values,
    None or positive; ``counts``: the same, each at least 0 (``ranks_per_trial`` at least 1)."""
    from clusterkit.errors import BadInput

    for option, value in counts.items():
        least = 1 if option == "ranks_per_trial" else 0
        if value < least:
            flag = "--" + option.replace("_", "-")
            raise BadInput(f"{flag} must be {'at least 1' if least else '0 or more'}, got {value}")
    if trials < 1:
        raise BadInput(f"--trials must be at least 1, got {trials}")
    if direction not in ("minimize", "maximize"):
        raise BadInput(f"--direction must be minimize or maximize, got {direction!r}")
    if gpus_per_trial < 0:
        raise BadInput(f"--gpus-per-trial must be 0 or more, got {gpus_per_trial:g}")
    for option, value in seconds.items():
        if value is not None and value <= 0:
            raise BadInput(f"--{option.replace('_', '-')} must be positive, got {value:g}")


WORKDIR = typer.Option(
    None, "--workdir", help="Project directory trials run in (default: the file's)."
)
WORKDIR_MAX_SIZE = typer.Option(
    None, "--workdir-max-size", help="Largest project to copy, e.g. 200MiB (100MiB)."
)
TRIAL_WALLTIME = typer.Option(
    None,
    "--trial-walltime",
    help="Seconds a trial likely takes, till 3 finished (then their p90): trials start only on "
    "workers with that much walltime left; those with less retire.",
)


def hpo(
    context: typer.Context,
    target: str = typer.Argument(..., metavar="FILE.py:FUNC", help="The Optuna objective."),
    profile: str = typer.Option(None, "--profile", "-p", help="Profile name or path."),
    trials: int = typer.Option(..., "--trials", "-n", help="Total finished trials to reach."),
    storage: str = typer.Option(
        None, "--storage", help="Database URL or journal file; default ./STUDY.optuna.log."
    ),
    study_name: str = typer.Option(None, "--study-name", help="Default: FILE-FUNC."),
    direction: str = typer.Option("minimize", "--direction", help="minimize or maximize."),
    gpus_per_trial: float = typer.Option(0, "--gpus-per-trial", help="GPU units per trial."),
    ranks_per_trial: int = typer.Option(
        1, "--ranks-per-trial", help="DDP ranks per trial (torchrun env), slots reserved together."
    ),
    checkpoint_dir: str = typer.Option(
        None, "--checkpoint-dir", help="Multi-rank trials' checkpoints: URL or path, per trial."
    ),
    timeout: float = typer.Option(None, "--timeout", help="Seconds after which none starts."),
    trial_walltime: float = TRIAL_WALLTIME,
    lookahead: int = typer.Option(1, "--lookahead", help="Trials queued per busy slot; 0: none."),
    out: str = typer.Option(None, "--out", help="Results folder; default ./STUDY-results."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress."),
    workdir: str = WORKDIR,
    no_workdir: bool = typer.Option(False, "--no-workdir", help="Ship the objective alone."),
    workdir_max_size: str = WORKDIR_MAX_SIZE,
    detach: bool = typer.Option(False, "--detach", "-d", help="Run detached; print its ID."),
    max_restarts: int = typer.Option(3, "--max-restarts", help="Detached: driver restarts."),
    batch: bool = typer.Option(
        False, "--batch", help="Run all of it in one SLURM/PBS job; print its ID."
    ),
    dashboard: bool = typer.Option(
        False, "--dashboard", help="Live optuna-dashboard of the study, read-only, on 127.0.0.1."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    mlflow: str = typer.Option(None, "--mlflow", help="MLflow tracking URI: a run per trial."),
) -> str | None:
    """Search hyperparameters: every worker slot busy, resumable with the same storage.

    With --detach the search runs in the background (`clusterkit runs` lists it).
    With --batch, scheduler, driver and workers run in one job of the profile's batch system."""
    counts = {"max_restarts": max_restarts, "ranks_per_trial": ranks_per_trial}
    seconds = {"timeout": timeout, "trial_walltime": trial_walltime}
    _check_numbers(trials, direction, gpus_per_trial, seconds, lookahead=lookahead, **counts)
    from clusterkit.runners.hpo import inputs as hpo_inputs

    project = None if no_workdir else _project(target, workdir, workdir_max_size)
    with _on_path(project.root if project is not None else None):
        objective = hpo_inputs.load_objective(target)
    if profile is not None and not cluster_is_up(profile):  # an unknown profile fails here
        from clusterkit.profiles import load_profile

        load_profile(profile)
    name = study_name or hpo_inputs.default_study_name(objective)
    store = hpo_inputs.resolve_storage(storage, name)
    if detach or batch:
        return _detach(name, context.params)
    _attached(objective, store, name, project, context.params)
    return None


def _attached(objective: Any, store: Any, name: str, project: Any, params: dict[str, Any]) -> None:
    """The search, driven from this process, and its result (:mod:`.hpo_output`)."""
    from clusterkit.cli import hpo_output

    hpo_output.attached(_search, objective, store, name, project, params)


def _search(objective: Any, store: Any, name: str, project: Any, params: dict[str, Any]) -> Any:
    """The search's study, searched from this process."""
    from clusterkit.cli.runs import search_dashboard
    from clusterkit.client import get_client
    from clusterkit.runners.hpo import run
    from clusterkit.runners.hpo.callbacks import mlflow_callback

    callbacks = [mlflow_callback(params["mlflow"])] if params["mlflow"] else []
    folder = params["out"] or f"{name}-results"
    gpus = params["gpus_per_trial"]
    client = get_client(params["profile"])
    view = search_dashboard(params["dashboard"], store, name, client, params["profile"])
    try:
        study = run(
            objective,
            n_trials=params["trials"],
            client=client,
            storage=store,
            study_name=name,
            direction=params["direction"],
            resources={"GPU": gpus} if gpus else None,
            timeout=params["timeout"],
            trial_walltime=params["trial_walltime"],
            progress=params["progress"],
            out=folder,
            workdir=project,
            ranks_per_trial=params["ranks_per_trial"],
            checkpoint_dir=params["checkpoint_dir"],
            lookahead=params["lookahead"],
            callbacks=callbacks,
        )
    finally:
        view.close()
        client.close()
    return study


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _detach(name: str, params: dict[str, Any]) -> str:
    """Record the checked search and start it detached; the run ID, printed. Paths are absolute:
    the driver resolves nothing against a terminal's directory that may be gone."""
    from clusterkit.runs import submit

    file, _, function = params["target"].rpartition(":")
    profile, storage = params["profile"], params["storage"] or f"{name}.optuna.log"
    out = _absolute(params["out"] or f"{name}-results")
    if profile is not None and profile.endswith((".yaml", ".yml")):
        profile = _absolute(profile)
    argv = [f"{_absolute(file)}:{function}", "--trials", str(params["trials"])]
    argv += ["--study-name", name, "--direction", params["direction"], "--out", out]
    argv += ["--storage", storage if "://" in storage else _absolute(storage)]
    if profile is not None:
        argv += ["--profile", profile]
    if params["gpus_per_trial"]:
        argv += ["--gpus-per-trial", str(params["gpus_per_trial"])]
    if params["timeout"] is not None:
        argv += ["--timeout", str(params["timeout"])]
    if params["trial_walltime"] is not None:
        argv += ["--trial-walltime", str(params["trial_walltime"])]
    if params["ranks_per_trial"] != 1:
        argv += ["--ranks-per-trial", str(params["ranks_per_trial"])]
    if params["lookahead"] != 1:
        argv += ["--lookahead", str(params["lookahead"])]
    if params["mlflow"] is not None:
        argv += ["--mlflow", params["mlflow"]]
    if params["checkpoint_dir"] is not None:
        url = params["checkpoint_dir"]
        argv += ["--checkpoint-dir", url if "://" in url else _absolute(url)]
    if params["no_workdir"]:
        argv.append("--no-workdir")
    elif params["workdir"] is not None:
        argv += ["--workdir", _absolute(params["workdir"])]
    if params["workdir_max_size"] is not None:
        argv += ["--workdir-max-size", params["workdir_max_size"]]
    restarts, batch = params["max_restarts"], params["batch"]
    run_id = submit("hpo", argv, profile=profile, results=out, max_restarts=restarts, batch=batch)
    typer.echo(run_id)
    return run_id


def register(app: typer.Typer) -> None:
    app.command()(hpo)
