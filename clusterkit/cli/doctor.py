"""`clusterkit doctor [PROFILE]`."""

from __future__ import annotations

import typer

from clusterkit.cli.complete import profile_names


def doctor(
    profile: str = typer.Argument(
        "local", help="Profile name or path.", autocompletion=profile_names
    ),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check this machine against a profile: a pass/fail row with a fix for each check.

    A warning line names Dask, distributed, Optuna or torch installed outside the tested range.
    """
    from rich.text import Text

    from clusterkit import console
    from clusterkit.doctor import run_checks, version_warnings
    from clusterkit.errors import EXIT_RUNTIME
    from clusterkit.profiles import load_profile

    checks = run_checks(load_profile(profile))
    for line in version_warnings():  # stderr, one line each: the table and --json stay as they are
        console.warn(line)
    if json_:
        console.print_json([c.__dict__ for c in checks])
    else:
        console.table(
            None,
            ["check", "result", "detail", "fix"],
            [
                (
                    c.name,
                    Text("pass", style="green") if c.ok else Text("FAIL", style="red"),
                    c.detail,
                    "" if c.ok else c.fix,
                )
                for c in checks
            ],
        )
    if not all(c.ok for c in checks):
        raise typer.Exit(EXIT_RUNTIME)


def register(app: typer.Typer) -> None:
    app.command()(doctor)
