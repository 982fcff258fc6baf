"""`clusterkit profiles list|show|validate|render|schema`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

profiles_app = typer.Typer(help="List, show, validate and render profiles.", no_args_is_help=True)

RENDER_FORMATS = ("native", "helm-values", "tfvars")


def register(app: typer.Typer) -> None:
    app.add_typer(profiles_app, name="profiles")


def _worker_counts(profile: Any) -> tuple[int | str, int, int | str | None]:
    """Dask workers started, waited for by `up` (minimum) and reachable with adapt (maximum)."""
    minimum = int(profile.min_workers)
    if getattr(profile, "workers", 0) is None and profile.adapt_spec is None:
        return "per GPU", minimum, "per GPU"  # local-cuda: one worker per visible GPU
    if not hasattr(profile, "worker_shapes"):  # address: someone else's cluster
        return profile.workers, minimum, None
    maximum = sum(count for count, _, _ in profile.worker_shapes())  # all worker groups
    started = maximum if profile.adapt_spec is None else profile.workers
    return started, minimum, maximum


def _row(name: str, path: Path) -> dict[str, Any]:
    from clusterkit.errors import ProfileError
    from clusterkit.profiles import load_profile

    try:
        profile = load_profile(path)
    except ProfileError as error:
        return {"name": name, "backend": "?", "workers": None, "min_workers": None,
                "max_workers": None, "gpus": None, "source": str(path),
                "error": error.one_line()}  # fmt: skip
    started, minimum, maximum = _worker_counts(profile)
    return {
        "name": name,
        "backend": profile.backend_name,
        "workers": started,
        "min_workers": minimum,
        "max_workers": maximum,
        "gpus": getattr(getattr(profile, "worker", None), "gpus", 0),
        "source": profile.source,
        "error": None,
    }


@profiles_app.command("list")
def list_(json_: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Profiles on the search path by name: backend, workers (started, min, max), GPUs, source."""
    from rich.text import Text

    from clusterkit import console
    from clusterkit.profiles import discover

    rows = [_row(name, path) for name, path in sorted(discover().items())]
    if json_:
        console.print_json(rows)
        return
    console.table(
        None,
        ["name", "backend", "workers", "min", "max", "GPUs/worker", "source"],
        [
            (
                r["name"],
                r["backend"] if not r["error"] else Text("invalid", style="red"),
                r["workers"],
                r["min_workers"],
                "-" if r["max_workers"] is None else r["max_workers"],
                r["gpus"],
                r["source"],
            )
            for r in rows
        ],
    )


@profiles_app.command("show")
def show(
    name: str = typer.Argument(..., help="Profile name or path to a .yaml file."),
    json_: bool = typer.Option(False, "--json", help="JSON instead of YAML."),
) -> None:
    """The profile resolved after `extends`, ${ENV} interpolation and defaults."""
    import yaml

    from clusterkit import console
    from clusterkit.profiles import resolved_data
    from clusterkit.security import exposure

    data = resolved_data(name)
    address = data.get("address") or (data.get("scheduler") or {}).get("host")
    notice = exposure(str(data.get("protocol", "tls")), address)
    if notice:
        console.warn(notice)
    if json_:
        console.print_json(data)
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())


@profiles_app.command("validate")
def validate(
    refs: list[str] = typer.Argument(None, help="Names or paths; default: every profile."),
) -> None:
    """Validate profiles; each failure is one line; exit 2 if any fails."""
    from clusterkit.errors import EXIT_BAD_INPUT, ProfileError
    from clusterkit.profiles import discover, load_profile

    targets: list[str | Path] = list(refs) if refs else [p for _, p in sorted(discover().items())]
    failures = 0
    for ref in targets:
        try:
            profile = load_profile(ref)
            typer.echo(f"ok   {profile.name} ({profile.source})")
        except ProfileError as error:
            failures += 1
            typer.echo(f"error: {error.one_line()}", err=True)
    if failures:
        raise typer.Exit(EXIT_BAD_INPUT)


@profiles_app.command("render")
def render(
    name: str = typer.Argument(..., help="Profile name or path."),
    format_: str = typer.Option(
        "native",
        "--format",
        "-f",
        help="native (what the backend runs), helm-values or tfvars (kubernetes profiles).",
    ),
    explain: bool = typer.Option(
        False,
        "--explain",
        help="Each setting with its value and source: profile file:line, Dask config key "
        "(SLURM/PBS options the profile leaves unset), default or derived.",
    ),
) -> None:
    """What the backend would run: job script, commands per host, manifest."""
    from clusterkit.errors import BadInput

    if explain:
        from clusterkit import console, profiles, siteconfig

        rows = siteconfig.explain(*profiles.load_located(name))
        console.table(None, ["setting", "value", "source"], rows)
        return
    if format_ not in RENDER_FORMATS:
        raise BadInput(f"unknown format {format_!r}", hint=f"one of: {', '.join(RENDER_FORMATS)}")
    if format_ == "native":
        from clusterkit.api import render as render_profile

        typer.echo(render_profile(name).rstrip())
        return
    import yaml

    from clusterkit import exporters
    from clusterkit.profiles import load_profile
    from clusterkit.schema import KubernetesProfile

    profile = load_profile(name)
    if not isinstance(profile, KubernetesProfile):
        raise BadInput(
            f"--format {format_} exports kubernetes profiles; '{profile.name}' is "
            f"{profile.backend_name}"
        )
    part, notes = exporters.exportable(profile)
    if format_ == "helm-values":
        typer.echo(yaml.safe_dump(exporters.to_helm_values(part), sort_keys=False).rstrip())
    else:
        typer.echo(exporters.to_tfvars(part).rstrip())
    from clusterkit.console import warn

    for note in notes:
        warn(f"{profile.name}: {note}")


@profiles_app.command("schema")
def schema() -> None:
    """JSON Schema of a profile file (for editors)."""
    from clusterkit import console
    from clusterkit.schema import json_schema

    console.print_json(json_schema())
