"""`clusterkit hpo FILE.py:FUNC`: an asynchronous Optuna search on a profile's cluster."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand

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

DIRECTIONS = typer.Option(
    None,
    "--directions",
    metavar="DIRECTION...",
    help="Several objectives, one per value returned: --directions minimize maximize.",
)
SAMPLER = typer.Option(
    None,
    "--sampler",
    metavar="NAME",
    help="An optuna.samplers class, e.g. TPESampler, NSGAIISampler, GPSampler, GridSampler.",
)
PRUNER = typer.Option(
    None,
    "--pruner",
    metavar="NAME",
    help="An optuna.pruners class, e.g. MedianPruner, HyperbandPruner, PatientPruner.",
)
TARGET = typer.Argument(
    ...,
    metavar="FILE.py:FUNC|SCRIPT.py",
    help="An Optuna objective, or a whole Optuna script run as written (args after --).",
)
TRIALS = typer.Option(None, "--trials", "-n", help="Total finished trials to reach (FILE.py:FUNC).")
STORAGE = typer.Option(
    None, "--storage", help="Database URL or journal file; default ./STUDY.optuna.log."
)
DIRECTION = typer.Option(
    None,
    "--direction",
    metavar="DIRECTION",
    help="minimize (the default) or maximize; several objectives: --directions.",
)
SAMPLER_KWARGS = typer.Option(
    None, "--sampler-kwargs", metavar="JSON", help="""Its arguments, e.g. '{"seed": 1}'."""
)
PRUNER_KWARGS = typer.Option(
    None,
    "--pruner-kwargs",
    metavar="JSON",
    help="""Its arguments, e.g. '{"n_warmup_steps": 5}'.""",
)
RANKS_PER_TRIAL = typer.Option(
    1, "--ranks-per-trial", help="DDP ranks per trial (torchrun env), slots reserved together."
)
CHECKPOINT_DIR = typer.Option(
    None,
    "--checkpoint-dir",
    help="Trials' checkpoints: a folder per trial, under this path or URL.",
)
BATCH = typer.Option(False, "--batch", help="Run all of it in one SLURM/PBS job; print its ID.")
DASHBOARD = typer.Option(
    False, "--dashboard", help="Live optuna-dashboard of the study, read-only, on 127.0.0.1."
)
MAX_RETRIES = typer.Option(
    2, "--max-retries", help="Re-runs of a trial whose worker was lost with nothing saved."
)
MAX_RESUMES = typer.Option(
    10, "--max-resumes", help="Resumes of a trial from the checkpoint it saved (walltime)."
)


def hpo(
    context: typer.Context,
    target: str = TARGET,
    profile: str = typer.Option(None, "--profile", "-p", help="Profile name or path."),
    trials: int = TRIALS,
    storage: str = STORAGE,
    study_name: str = typer.Option(None, "--study-name", help="Default: FILE-FUNC."),
    direction: list[str] = DIRECTION,
    directions: list[str] = DIRECTIONS,
    sampler: str = SAMPLER,
    sampler_kwargs: str = SAMPLER_KWARGS,
    pruner: str = PRUNER,
    pruner_kwargs: str = PRUNER_KWARGS,
    gpus_per_trial: float = typer.Option(0, "--gpus-per-trial", help="GPU units per trial."),
    ranks_per_trial: int = RANKS_PER_TRIAL,
    checkpoint_dir: str = CHECKPOINT_DIR,
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
    batch: bool = BATCH,
    dashboard: bool = DASHBOARD,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    mlflow: str = typer.Option(None, "--mlflow", help="MLflow tracking URI: a run per trial."),
) -> str | None:
    """Search hyperparameters: every worker slot busy, resumable with the same storage.

    SCRIPT.py runs as `python SCRIPT.py ARGS` would, each study.optimize on the cluster.
    With --detach the search runs in the background (`clusterkit runs` lists it).
    With --batch, scheduler, driver and workers run in one job of the profile's batch system."""
    return _run(context, direction, directions, detach, batch, max_restarts)


def _run(
    context: typer.Context,
    direction: list[str] | None,
    directions: list[str] | None,
    detach: bool,
    batch: bool,
    max_restarts: int,
) -> str | None:
    """The search the command line names: checked, then run here or detached (its ID)."""
    from clusterkit.runners.hpo.knobs import check_directions
    from clusterkit.runs.execution import check_restarts, execute, prepare
    from clusterkit.runs.spec import HpoOptions, RunSpec

    given = check_directions(direction, directions)  # a second --direction is refused
    skip = ("kind", "directions", "script_args")
    options = {name: context.params[name] for name in HpoOptions.model_fields if name not in skip}
    options["script_args"] = tuple(context.args)
    if given is not None:
        options["directions"] = given
    check_restarts("hpo", max_restarts)
    spec = RunSpec.hpo(context.params["target"], profile=context.params["profile"], **options)
    prepared = prepare(spec)
    if detach or batch:
        from clusterkit.runs.launching import detach as detach_run

        run_id = detach_run(spec, max_restarts=max_restarts, batch=batch, prepared=prepared)
        typer.echo(run_id)
        return run_id
    status = execute(spec, prepared)
    if status:  # a script's own exit status
        raise typer.Exit(status)
    return None


def spread_directions(args: list[str]) -> list[str]:
    """``--directions minimize maximize`` as click takes a list, ``--directions minimize
    --directions maximize``: ``--directions`` takes the words up to the next option, ``--`` or
    FILE.py:FUNC (Optuna's CLI: argparse's ``nargs="+"``)."""
    spread: list[str] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        flag, equals, value = arg.partition("=")
        if arg == "--" or flag != "--directions" or not (equals or _word(rest)):
            spread.append(arg)
            if arg == "--":
                return spread + rest
            continue
        values = [value if equals else rest.pop(0)]
        while _word(rest) and ":" not in rest[0]:
            values.append(rest.pop(0))
        for each in values:
            spread += ["--directions", each]
    return spread


def _word(args: list[str]) -> bool:
    """Whether the next argument is a value, not an option."""
    return bool(args) and not args[0].startswith("-")


class _HpoCommand(TyperCommand):
    """``clusterkit hpo``: ``--directions`` takes several values (:func:`spread_directions`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_directions(args))


def register(app: typer.Typer) -> None:
    app.command(cls=_HpoCommand, context_settings={"allow_extra_args": True})(hpo)
