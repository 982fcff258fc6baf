"""`clusterkit train FILE.py[:FUNC] --profile NAME [-- script args...]`: DDP on a cluster."""

from __future__ import annotations

from typing import Any

import typer


def _capacity(profile: Any) -> int | None:
    """Most ranks the profile's cluster can ever provide, or None when it cannot be known."""
    from clusterkit.runs.training import capacity

    return capacity(profile)


def train(
    context: typer.Context,
    target: str = typer.Argument(..., help="FILE.py (torchrun-style script) or FILE.py:FUNC."),
    profile: str = typer.Option(None, "--profile", "-p", help="Profile (default: local)."),
    world_size: int = typer.Option(None, "--world-size", "-n", help="Ranks (default: all)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restarts from checkpoint."),
    timeout: float = typer.Option(None, "--timeout", help="Seconds for the whole run."),
    workdir: str = typer.Option(
        None, "--workdir", help="Project directory ranks run in (default: the script's)."
    ),
    no_workdir: bool = typer.Option(
        False, "--no-workdir", help="Ship the script file alone into a temporary directory."
    ),
    workdir_max_size: str = typer.Option(
        None, "--workdir-max-size", help="Largest project to copy, e.g. 200MiB (100MiB)."
    ),
    checkpoint_dir: str = typer.Option(
        None, "--checkpoint-dir", help="fsspec URL or path for checkpoints (s3://..., /shared)."
    ),
    tracebacks: bool = typer.Option(
        False, "--tracebacks", help="Print each failed rank's traceback (detached: always)."
    ),
    detach: bool = typer.Option(False, "--detach", "-d", help="Run detached; print its ID."),
    driver_restarts: int = typer.Option(3, "--driver-restarts", help="Detached: restarts."),
    batch: bool = typer.Option(
        False, "--batch", help="Run all of it in one SLURM/PBS job; print its ID."
    ),
) -> str | None:
    """Train with DistributedDataParallel: one rank per worker (per GPU), torchrun's env.

    Arguments after `--` go to the script as sys.argv[1:] (or to FUNC as strings).
    Ranks run in the project directory (in place on a shared disk, else a synced copy).
    Each rank's stdout and stderr show here as they are written, a line at a time: [rank1]: ...
    A failed rank is one line; --tracebacks adds its traceback.
    The status line shows rank 0's latest progress: its checkpoints' epoch, or what it reports.
    """
    from clusterkit.runs.execution import check_restarts, execute, prepare
    from clusterkit.runs.spec import RunSpec, TrainOptions

    names = [name for name in TrainOptions.model_fields if name not in ("kind", "script_args")]
    options = {name: context.params[name] for name in names}
    spec = RunSpec.train(target, profile=profile, script_args=context.args, **options)
    prepared = prepare(spec)
    if detach or batch:
        from clusterkit.runs.launching import detach as detach_run

        check_restarts("train", driver_restarts)
        run_id = detach_run(spec, max_restarts=driver_restarts, batch=batch, prepared=prepared)
        typer.echo(run_id)
        return run_id
    code = execute(spec, prepared)
    if code:
        raise typer.Exit(code)
    return None


def register(app: typer.Typer) -> None:
    app.command(
        "train",
        # only what follows `--` goes to the script: a mistyped option before it is an error
        context_settings={"allow_extra_args": True},
    )(train)
