"""`clusterkit runs [logs|wait|stop|show]`: detached searches and trainings."""

from __future__ import annotations

import contextlib
import signal
import sys
import time

import typer

runs_app = typer.Typer(
    help="Detached runs (`hpo|train --detach|--batch`): list, follow, wait, stop, resume, show.",
    invoke_without_command=True,
)


def _when(stamp: float | None) -> str:
    return "" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


@runs_app.callback()
def runs(
    context: typer.Context,
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Runs: ID, kind, profile or cluster, state, progress, best value, started, restarts."""
    if context.invoked_subcommand is not None:
        return
    from clusterkit import console
    from clusterkit.runs import list_runs

    rows = list_runs()
    if json_:
        console.print_json(rows)
        return
    if not rows:
        console.message("no runs (start one with `clusterkit hpo|train ... --detach`)")
        return
    console.table(
        None,
        ["id", "kind", "on", "state", "progress", "best", "started", "restarts"],
        [
            (
                r["id"],
                r["kind"],
                r["target"],
                r["state"],
                r["progress"],
                r["best"],
                _when(r["started"]),
                _restarts(r),
            )
            for r in rows
        ],
    )


def _restarts(row: dict[str, object]) -> str:
    count, reasons = row.get("restarts"), row.get("restart_reasons") or []
    if not count:
        return "" if count is None else "0"
    return f"{count} ({reasons[-1]})" if isinstance(reasons, list) and reasons else str(count)


@runs_app.command()
def logs(
    run_id: str = typer.Argument(
        ..., metavar="ID", help="The run's ID, as `clusterkit runs` lists it."
    ),
    follow: bool = typer.Option(False, "--follow", "-f", help="Follow until the run ends."),
    lines: int = typer.Option(None, "--lines", "-n", help="Only the last N lines first."),
) -> None:
    """The driver's output, every attempt, with the progress line."""
    from clusterkit import runs

    for chunk in runs.logs(run_id, follow=follow, lines=lines):
        sys.stdout.write(chunk)
        sys.stdout.flush()


@runs_app.command()
def wait(
    run_id: str = typer.Argument(
        ..., metavar="ID", help="The run's ID, as `clusterkit runs` lists it."
    ),
    timeout: float = typer.Option(None, "--timeout", help="Seconds to wait at most."),
) -> None:
    """Block until the run ends; exit with its status (0: succeeded)."""
    from clusterkit import console, runs

    code = runs.wait(run_id, timeout=timeout)
    record = runs.show(run_id)
    console.message(f"{run_id}: {record['state']}")
    raise typer.Exit(code)


@runs_app.command()
def stop(
    run_id: str = typer.Argument(
        ..., metavar="ID", help="The run's ID, as `clusterkit runs` lists it."
    ),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds before the driver is killed."),
) -> None:
    """Stop the driver gracefully: the study keeps every finished trial; the cluster stays."""
    from clusterkit import console, runs

    record = runs.stop(run_id, timeout=timeout)
    console.message(f"{run_id}: {record.state}" + (f" ({record.reason})" if record.reason else ""))


@runs_app.command()
def resume(
    run_id: str = typer.Argument(
        ..., metavar="ID", help="The run's ID, as `clusterkit runs` lists it."
    ),
) -> None:
    """Start a lost run again (its monitor or batch job is gone); it resumes where it was."""
    from clusterkit import console, runs

    record = runs.resume(run_id)
    console.message(f"{run_id}: {record.state} (restart {record.restarts})")


@runs_app.command()
def show(
    run_id: str = typer.Argument(
        ..., metavar="ID", help="The run's ID, as `clusterkit runs` lists it."
    ),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Results folder, log, driver host and pid, restarts and why; a search's hours held."""
    from clusterkit import console, runs
    from clusterkit.runners.hpo import account

    info = runs.show(run_id)
    held = account.read(_results(info))  # a search's account.json, once written
    if json_:
        console.print_json({**info, "account": held.to_json() if held else None})
        return
    info["hours"] = account.line(held).removeprefix("hours: ") if held else None
    info["started"], info["ended"] = _when(info["started"]), _when(info["ended"])
    reasons = info.pop("restart_reasons")
    info["restarts"] = f"{info['restarts']}/{info.pop('max_restarts')}"
    info["driver"] = f"pid {info.pop('driver_pid')} on {info.pop('host')}"
    for key, value in info.items():
        if value not in (None, ""):
            typer.echo(f"{key + ':':12} {value}")
    for number, reason in enumerate(reasons, 1):
        console.message(f"restart {number}: {reason}")


def _results(info: dict[str, object]) -> str | None:
    """The run's results folder, a relative one from its working directory."""
    import os

    results = info.get("results")
    return os.path.join(str(info.get("cwd") or ""), str(results)) if results else None


@runs_app.command()
def dashboard(
    run_id: str = typer.Argument(
        ..., metavar="ID", help="The run's ID, as `clusterkit runs` lists it."
    ),
    port: int = typer.Option(0, "--port", help="Port on 127.0.0.1; 0: a free one."),
    artifacts: str = typer.Option(
        None, "--artifacts", help="The trials' artifact store: a folder or s3://BUCKET."
    ),
) -> None:
    """Serve the search's study in optuna-dashboard, read-only, on 127.0.0.1 until Ctrl-C.

    The cluster's Dask dashboard is linked beside it.
    With --artifacts, each trial's page shows the files it uploaded."""
    from clusterkit.errors import BadInput
    from clusterkit.runners.hpo import dashboard as study_dashboard
    from clusterkit.runs.dashboard import study_of

    if not 0 <= port <= 65535:
        raise BadInput(f"--port must be 0..65535, got {port}")
    study = study_of(run_id)
    serving = study_dashboard.serve(study.storage, study.study_name, port=port, artifacts=artifacts)
    with serving as view:
        for line in study_dashboard.links(view, cluster=study.cluster):
            typer.echo(line)
        typer.echo("serving until Ctrl-C", err=True)
        with contextlib.suppress(KeyboardInterrupt):
            _until_interrupted()


def _until_interrupted() -> None:
    """Sleep until Ctrl-C (or SIGTERM, taken as one)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    while True:
        time.sleep(3600)


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs")
