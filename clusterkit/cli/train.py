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


def train(
    context: typer.Context,
    target: str = typer.Argument(..., help="FILE.py (torchrun-style script) or FILE.py:FUNC."),
    profile: str = typer.Option(None, "--profile", "-p", help="Profile (default: local)."),
    world_size: int = typer.Option(None, "--world-size", "-n", help="Ranks (default: all)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restarts from checkpoint."),
    timeout: float = typer.Option(None, "--timeout", help="Seconds for the whole run."),
) -> None:
    """Train with DistributedDataParallel: one rank per worker (per GPU), torchrun's env.

    Arguments after `--` go to the script as sys.argv[1:] (or to FUNC as strings).
    """
    from clusterkit import console
    from clusterkit.errors import BadInput
    from clusterkit.profiles import load_profile
    from clusterkit.runners.ddp.script import load_target

    loaded = load_target(target)
    if world_size is not None and world_size < 1:
        raise BadInput(f"--world-size must be at least 1, got {world_size}")
    if max_restarts < 0:
        raise BadInput(f"--max-restarts must be 0 or more, got {max_restarts}")
    model = load_profile(profile)
    capacity = _capacity(model)
    if world_size is not None and capacity is not None and world_size > capacity:
        raise BadInput(
            f"--world-size {world_size} is more than profile '{model.name}' can provide "
            f"({capacity} ranks)"
        )

    from clusterkit.client import get_client
    from clusterkit.runners.ddp.script import run_file

    client = get_client(model)
    try:
        with console.err().status(f"training {loaded.path.name} on '{model.name}'..."):
            results = run_file(
                loaded,
                list(context.args),
                client=client,
                world_size=world_size,
                max_restarts=max_restarts,
                timeout=timeout,
            )
    finally:
        client.close()
    console.table(None, ["rank", "result"], [(r, repr(v)) for r, v in enumerate(results)])


def register(app: typer.Typer) -> None:
    app.command(
        "train",
        # only what follows `--` goes to the script: a mistyped option before it is an error
        context_settings={"allow_extra_args": True},
    )(train)
