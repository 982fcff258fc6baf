"""`clusterkit up|down|ls|status|scale|logs|dashboard`."""

from __future__ import annotations

import os
import sys
import time

import typer

from clusterkit.cli.complete import cluster_names, profile_names


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def up(
    profile: str = typer.Argument(
        "local", help="Profile name or path.", autocompletion=profile_names
    ),
    name: str = typer.Option(None, "--name", help="Cluster name (default: the profile's)."),
) -> None:
    """Start a cluster from a profile; it runs until `clusterkit down`."""
    from clusterkit import api, cli, console
    from clusterkit.security import exposure

    # the spinner (rich, and a thread) starts only once the supervisor is forked
    record = api.up(profile, name=name, waiting=console.spinner(f"starting '{name or profile}'..."))
    console.message(f"[green]up[/green] {record.name}: {record.address}")
    notice = exposure(record.security.get("protocol", "tcp"), record.address)
    if notice:
        console.warn(notice)
    if record.dashboard:
        from clusterkit.monitor import dashboard_link

        console.message(f"dashboard: {dashboard_link(record)}")
    typer.echo(record.address)
    if cli.PROCESS_ENDS_WITH_COMMAND:
        # nothing is left to do: skip the teardown of what `up` imported (distributed's exit
        # hooks), a third of a second for nothing
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def down(
    name: str = typer.Argument(None, help="Cluster name.", autocompletion=cluster_names),
    all_: bool = typer.Option(False, "--all", help="Every cluster that is up."),
    dead: bool = typer.Option(False, "--dead", help="With --all: only dead clusters."),
    yes: bool = typer.Option(False, "--yes", "-y", help="With --all: do not ask."),
    timeout: float = typer.Option(30.0, help="Seconds of graceful close before killing."),
) -> None:
    """Close a cluster (gracefully, then its process group) and remove its record.

    A dead cluster (its supervisor gone) is reaped: what carries its tags is removed.
    """
    from clusterkit import api, console
    from clusterkit.errors import BadInput

    if all_ == bool(name):
        raise BadInput("give a cluster name or --all (not both)")
    if dead and not all_:
        raise BadInput("--dead goes with --all")
    if all_ and not yes and sys.stdin.isatty():
        from clusterkit import state

        every = [r.name for r in state.records()] + [u.name for u in state.unreadable_records()]
        if every and not typer.confirm(f"stop {len(every)} cluster(s): {', '.join(every)}?"):
            raise typer.Exit(1)
    if all_:
        names = api.down_all(timeout=timeout, dead_only=dead)
    else:
        stopped = api.stop_runs_on(name)  # api.down would too, silently
        if stopped:
            console.message(f"stopped run(s) on cluster '{name}' first: {', '.join(stopped)}")
        api.down(name, timeout=timeout)
        names = [name]
    for closed in names:
        console.message(f"[green]down[/green] {closed}")
    if all_ and not names:
        console.message("no cluster was up")


def ls(
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
    kubernetes: bool = typer.Option(
        False, "--kubernetes", help="Also list the DaskClusters the kubeconfig can see."
    ),
    orphans: bool = typer.Option(
        False, "--orphans", help="Only dead clusters: a supervisor or embedding process gone."
    ),
) -> None:
    """Clusters that are up; dead and unreadable ones are listed so that `down` can end them."""
    from clusterkit import api, console

    rows = api.list_clusters(orphans=orphans)
    if kubernetes:
        resources = api.list_resources("kubernetes")
        if json_:
            console.print_json({"clusters": rows, "daskclusters": resources})
            return
        if resources:
            columns = list(resources[0])
            console.table("DaskClusters", columns, [[r.get(c) for c in columns] for r in resources])
    if json_:
        console.print_json(rows)
        return
    console.table(
        None,
        ["name", "backend", "address", "workers", "GPUs busy", "age", "state"],
        [
            (
                r["name"],
                r["backend"],
                r["address"],
                r["workers"],
                None if r["gpus"] is None else f"{r['gpus_busy']}/{r['gpus']}",
                _age(r["age"]),
                r["state"],
            )
            for r in rows
        ],
    )


def status(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh in place until Ctrl-C."),
    interval: float = typer.Option(2.0, help="Seconds between refreshes with --watch."),
    count: int = typer.Option(0, help="With --watch: stop after this many refreshes."),
) -> None:
    """Per worker: CPU, memory, GPU use, tasks running and queued; jobs or pods; scaling mode."""
    from clusterkit import api, console
    from clusterkit.cli.views import status_view

    if not watch:
        info = api.status(name)
        hours = _hours(name)  # the hours held since `up` and the share busy
        if json_:
            console.print_json({**info, "hours": hours})
        else:
            console.out().print(status_view(info))
            if hours is not None:
                held = f"{hours['held'] / 3600:.3g} core-h held since up"
                typer.echo(f"hours: {held}, {hours['share_busy']:.0%} busy")
        return
    from rich.live import Live

    with Live(console=console.out(), auto_refresh=False) as live:
        shown = 0
        while not count or shown < count:
            info = api.status(name)
            if json_:
                console.print_json(info)
            else:
                live.update(status_view(info), refresh=True)
            shown += 1
            if not count or shown < count:
                time.sleep(interval)


def _hours(name: str) -> dict[str, float] | None:
    """:func:`~clusterkit.runners.hpo.account.cluster_hours` of a cluster; None where its
    scheduler does not answer."""
    from clusterkit import api
    from clusterkit.client import connect
    from clusterkit.runners.hpo.account import cluster_hours

    try:
        with connect(api.get_record(name)) as client:
            return cluster_hours(client)
    except Exception:  # status shows what it can; the hours are a part of it
        return None


def scale(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    workers: int = typer.Argument(..., help="Number of workers."),
) -> None:
    """Set the number of workers and wait until they are there (ends adaptive scaling)."""
    from clusterkit import api, console

    if api.scale(name, workers):
        console.warn(f"{name}: adaptive scaling ended (`clusterkit adapt {name}` turns it on)")
    console.message(f"{name}: {workers} workers")


def adapt(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    minimum: int = typer.Option(None, "--min", help="Fewest workers."),
    maximum: int = typer.Option(None, "--max", help="Most workers."),
    off: bool = typer.Option(False, "--off", help="End adaptive scaling (keep the workers)."),
) -> None:
    """Scale with the load between --min and --max workers, or turn that off with --off."""
    from clusterkit import api, console
    from clusterkit.errors import BadInput

    if off == (minimum is not None or maximum is not None):
        raise BadInput("give --min/--max, or --off")
    if off:
        was = api.adapt(name)
        console.message(f"{name}: adaptive scaling {'ended' if was else 'was not on'}")
        return
    api.adapt(name, minimum, maximum)
    console.message(f"{name}: adaptive, {minimum or 0}..{maximum if maximum is not None else '-'}")


def logs(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    lines: int = typer.Option(200, "--lines", "-n", help="Lines per component."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    component: str = typer.Option(
        None,
        "--component",
        "-c",
        help="supervisor, scheduler, worker, 'worker NAME', or 'job ID' (SLURM/PBS: the job's "
        "own log, with what ran before its worker).",
    ),
    since: str = typer.Option(None, "--since", help="Only lines this recent, e.g. 10m."),
) -> None:
    """Supervisor, scheduler and worker logs; -f follows them."""
    from clusterkit import api

    if not follow:
        for part, entries in api.logs(name, lines=lines, component=component, since=since).items():
            typer.echo(f"==> {part} <==")
            for entry in entries:
                typer.echo(entry)
        return
    from clusterkit.monitor import follow as follow_logs

    def fetch() -> dict[str, list[str]]:
        return api.logs(name, lines=lines, component=component, since=since)

    last = None
    for part, entry in follow_logs(fetch):
        if part != last:
            typer.echo(f"==> {part} <==")
            last = part
        typer.echo(entry)


def dashboard(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    open_: bool = typer.Option(False, "--open", help="Open it in a browser."),
) -> None:
    """Print the dashboard link (and open it with --open).

    For a dashboard this machine cannot reach directly, the tunnel to run first."""
    from clusterkit import api, console
    from clusterkit.errors import BadInput
    from clusterkit.monitor import dashboard_link, dashboard_tunnel

    record = api.get_record(name)
    if not record.dashboard:
        raise BadInput(f"cluster '{name}' runs without a dashboard", hint="scheduler.dashboard")
    tunnel = dashboard_tunnel(record)
    link = dashboard_link(record) or record.dashboard
    if tunnel is not None:
        command, link = tunnel
        console.message(f"the dashboard listens on {record.host} only; first run: {command}")
    typer.echo(link)
    if open_:
        import webbrowser

        webbrowser.open(link)


def register(app: typer.Typer) -> None:
    for command in (up, down, ls, status, scale, adapt, logs, dashboard):
        app.command()(command)
