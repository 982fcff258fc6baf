"""`clusterkit up|down|ls|status|scale|logs|dashboard`."""

from __future__ import annotations

import typer


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def up(
    profile: str = typer.Argument("local", help="Profile name or path."),
    name: str = typer.Option(None, "--name", help="Cluster name (default: the profile's)."),
) -> None:
    """Start a cluster from a profile; it runs until `clusterkit down`."""
    from clusterkit import api, console

    # the spinner (a thread) starts only once the supervisor is forked
    record = api.up(
        profile, name=name, waiting=console.err().status(f"starting '{name or profile}'...")
    )
    console.message(f"[green]up[/green] {record.name}: {record.address}")
    if record.dashboard:
        console.message(f"dashboard: {record.dashboard}")
    typer.echo(record.address)


def down(
    name: str = typer.Argument(None, help="Cluster name."),
    all_: bool = typer.Option(False, "--all", help="Every cluster that is up."),
    dead: bool = typer.Option(False, "--dead", help="With --all: only dead clusters."),
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
    if all_:
        names = api.down_all(timeout=timeout, dead_only=dead)
    else:
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
) -> None:
    """Clusters that are up; dead and unreadable ones are listed so that `down` can end them."""
    from clusterkit import api, console

    rows = api.list_clusters()
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
        ["name", "backend", "address", "workers", "GPUs", "age", "state"],
        [
            (
                r["name"],
                r["backend"],
                r["address"],
                r["workers"],
                r["gpus"],
                _age(r["age"]),
                r["state"],
            )
            for r in rows
        ],
    )


def status(
    name: str = typer.Argument(..., help="Cluster name."),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Workers with threads, memory, GPUs and tasks processing; jobs or pods per backend."""
    from dask.utils import format_bytes

    from clusterkit import api, console

    info = api.status(name)
    if json_:
        console.print_json(info)
        return
    console.message(
        f"{info['name']} ({info['backend']}) at {info['address']}, up {_age(info['age'])}"
        + (f", dashboard {info['dashboard']}" if info["dashboard"] else "")
    )
    console.table(
        "workers",
        ["address", "threads", "memory", "limit", "GPUs", "processing"],
        [
            (
                w["address"],
                w["threads"],
                format_bytes(w["memory"] or 0),
                format_bytes(w["memory_limit"] or 0),
                w["gpus"],
                w["processing"],
            )
            for w in info["workers"]
        ],
    )
    if info["rows"]:
        console.table(
            None,
            ["kind", "name", "state", "detail"],
            [(r["kind"], r["name"], r["state"], r["detail"]) for r in info["rows"]],
        )


def scale(
    name: str = typer.Argument(..., help="Cluster name."),
    workers: int = typer.Argument(..., help="Number of workers."),
) -> None:
    """Set the number of workers and wait until they are there."""
    from clusterkit import api, console

    api.scale(name, workers)
    console.message(f"{name}: {workers} workers")


def logs(
    name: str = typer.Argument(..., help="Cluster name."),
    lines: int = typer.Option(200, "--lines", "-n", help="Lines per component."),
) -> None:
    """Supervisor, scheduler and worker logs."""
    from clusterkit import api

    for component, entries in api.logs(name, lines=lines).items():
        typer.echo(f"==> {component} <==")
        for entry in entries:
            typer.echo(entry)


def dashboard(
    name: str = typer.Argument(..., help="Cluster name."),
    open_: bool = typer.Option(False, "--open", help="Open it in a browser."),
) -> None:
    """Print the dashboard link (and open it with --open)."""
    from clusterkit import api
    from clusterkit.errors import BadInput

    record = api.get_record(name)
    if not record.dashboard:
        raise BadInput(f"cluster '{name}' runs without a dashboard", hint="scheduler.dashboard")
    typer.echo(record.dashboard)
    if open_:
        import webbrowser

        webbrowser.open(record.dashboard)


def register(app: typer.Typer) -> None:
    for command in (up, down, ls, status, scale, logs, dashboard):
        app.command()(command)
