"""`clusterkit hpo FILE.py:FUNC`: an asynchronous Optuna search on a profile's cluster."""

from __future__ import annotations

import typer

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

MAX_RETRIES = typer.Option(
    2, "--max-retries", help="Re-runs of a trial whose worker was lost with nothing saved."
)
MAX_RESUMES = typer.Option(
    10, "--max-resumes", help="Resumes of a trial from the checkpoint it saved (walltime)."
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
        None,
        "--checkpoint-dir",
        help="Trials' checkpoints: a folder per trial, under this path or URL.",
    ),
    max_retries: int = MAX_RETRIES,
    max_resumes: int = MAX_RESUMES,
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
    from clusterkit.runs.execution import check_restarts, execute, prepare
    from clusterkit.runs.spec import HpoOptions, RunSpec

    options = {name: context.params[name] for name in HpoOptions.model_fields if name != "kind"}
    check_restarts("hpo", max_restarts)
    spec = RunSpec.hpo(target, profile=profile, **options)
    prepared = prepare(spec)
    if detach or batch:
        from clusterkit.runs.launching import detach as detach_run

        run_id = detach_run(spec, max_restarts=max_restarts, batch=batch, prepared=prepared)
        typer.echo(run_id)
        return run_id
    execute(spec, prepared)
    return None


def register(app: typer.Typer) -> None:
    app.command()(hpo)
