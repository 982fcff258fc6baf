"""`clusterkit train FILE.py[:FUNC] --profile NAME [-- script args...]`: DDP on a cluster."""

from __future__ import annotations

from typing import Any

import typer


def _capacity(profile: Any) -> int | None:
    """Most ranks the profile's cluster can ever provide, or None when it cannot be known."""
    if not hasattr(profile, "rank_capacity"):  # an address profile: someone else's cluster
        return None
    capacity: int = profile.rank_capacity()
    return capacity


def _project(loaded: Any, workdir: str | None, max_size: str | None) -> Any:
    """Scan the project now: a bad or oversized directory fails before anything starts."""
    from clusterkit.runners.ddp.script import project_for
    from clusterkit.runners.workdir import AUTO, parse_max_size, scan

    if workdir is None:
        return None
    limit = parse_max_size("--workdir-max-size", max_size) if max_size else None
    if workdir != AUTO:
        return project_for(loaded, scan(workdir, max_size=limit))
    return project_for(loaded, scan(loaded.path.parent, max_size=limit))


def _checked_profile(profile: str | None, world_size: int | None, max_restarts: int) -> Any:
    """The profile, after checking the numbers against it (BadInput naming the option)."""
    from clusterkit.errors import BadInput
    from clusterkit.profiles import load_profile

    if world_size is not None and world_size < 1:
        raise BadInput(f"--world-size must be at least 1, got {world_size}")
    if max_restarts < 0:
        raise BadInput(f"--max-restarts must be 0 or more, got {max_restarts}")
    from clusterkit.cli.hpo import cluster_is_up

    if profile is not None and cluster_is_up(profile):  # a cluster from `up`, by its name
        return profile
    model = load_profile(profile)
    capacity = _capacity(model)
    if world_size is not None and capacity is not None and world_size > capacity:
        raise BadInput(
            f"--world-size {world_size} is more than profile '{model.name}' can provide "
            f"({capacity} ranks)"
        )
    return model


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
    from clusterkit.runners.ddp.script import load_target

    loaded = load_target(target)
    model = _checked_profile(profile, world_size, max_restarts)
    project = _project(loaded, None if no_workdir else (workdir or "auto"), workdir_max_size)
    if detach or batch:
        return _detach(loaded, list(context.args), context.params)
    _attached(loaded, model, project, list(context.args), context.params)
    return None


def _attached(
    loaded: Any, model: Any, project: Any, script_args: list[str], params: dict[str, Any]
) -> None:
    """The training, driven from this process; rank 0's progress on the status line."""
    from clusterkit import console
    from clusterkit.client import get_client
    from clusterkit.runners.ddp import TrainingFailed
    from clusterkit.runners.ddp.output import Printer
    from clusterkit.runners.ddp.progress import ProgressDisplay, describe
    from clusterkit.runners.ddp.script import run_file

    printer = Printer(params["tracebacks"] or None)  # None: as CLUSTERKIT_DEBUG says
    client = get_client(model)
    try:
        on = model if isinstance(model, str) else model.name
        with ProgressDisplay(f"training {loaded.path.name} on '{on}'") as display:
            printer.sink = display.write
            results = run_file(
                loaded,
                script_args,
                client=client,
                world_size=params["world_size"],
                max_restarts=params["max_restarts"],
                timeout=params["timeout"],
                workdir=project,
                checkpoint_dir=params["checkpoint_dir"],
                on_progress=display.update,
                stream_output=printer,
            )
    except TrainingFailed as error:
        if error.traceback and not printer.tracebacks:
            error.hint = "--tracebacks or CLUSTERKIT_DEBUG=1 prints the traceback"
        raise
    except KeyboardInterrupt:  # the ranks are stopped by now (the driver's unwinding)
        results = None
    finally:
        client.close()
    if results is None:
        typer.echo(f"interrupted: training {loaded.path.name} stopped", err=True)
        raise typer.Exit(130)
    if all(value is None for value in results):  # a torchrun-style script returns nothing
        last = f" ({describe(display.latest)})" if display.latest else ""
        console.message(f"trained {loaded.path.name}: {len(results)} ranks finished{last}")
    else:
        console.table(None, ["rank", "result"], [(r, repr(v)) for r, v in enumerate(results)])


def _detach(loaded: Any, script_args: list[str], params: dict[str, Any]) -> str:
    """Record the checked training, start it detached, print and return the run ID.

    Without --checkpoint-dir, checkpoints go to the run's folder in the state directory, so
    that a restarted driver resumes from the last one (workers must see that path: a local
    or shared-disk cluster; elsewhere pass --checkpoint-dir URL)."""
    from pathlib import Path

    from clusterkit import state
    from clusterkit.errors import BadInput
    from clusterkit.runs import new_id, submit

    def absolute(path: str) -> str:
        return str(Path(path).expanduser().resolve())

    if params["driver_restarts"] < 0:
        raise BadInput(f"--driver-restarts must be 0 or more, got {params['driver_restarts']}")
    run_id, checkpoints, profile = new_id("train"), params["checkpoint_dir"], params["profile"]
    if checkpoints is None:
        checkpoints = str(state.run_dir(run_id) / "checkpoints")
    elif "://" not in checkpoints:
        checkpoints = absolute(checkpoints)
    target = absolute(str(loaded.path)) + (f":{loaded.function}" if loaded.function else "")
    argv = [target, "--max-restarts", str(params["max_restarts"])]
    argv += ["--checkpoint-dir", checkpoints, "--tracebacks"]  # the run's log has them whole
    if profile is not None:
        profile = absolute(profile) if profile.endswith((".yaml", ".yml")) else profile
        argv += ["--profile", profile]
    for option in ("world_size", "timeout", "workdir_max_size"):
        if params[option] is not None:
            argv += [f"--{option.replace('_', '-')}", str(params[option])]
    if params["no_workdir"]:
        argv.append("--no-workdir")
    elif params["workdir"] is not None:
        argv += ["--workdir", absolute(params["workdir"])]
    if script_args:
        argv += ["--", *script_args]
    restarts = params["driver_restarts"]
    run_id = submit(
        "train",
        argv,
        profile=profile,
        results=checkpoints,
        max_restarts=restarts,
        run_id=run_id,
        batch=params["batch"],
    )
    typer.echo(run_id)
    return run_id


def register(app: typer.Typer) -> None:
    app.command(
        "train",
        # only what follows `--` goes to the script: a mistyped option before it is an error
        context_settings={"allow_extra_args": True},
    )(train)
