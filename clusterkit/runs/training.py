"""A training spec, run: its inputs checked before anything starts (:func:`prepare`), the spec
a detached run records (:func:`detached`), and the training driven from this process with
rank 0's progress on the status line (:func:`run`), in a terminal or a detached run's driver."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.client import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from clusterkit.runs.spec import RunSpec, TrainOptions


@dataclass
class Training:
    """What a training spec names, loaded: the script (and function), the profile (a cluster
    from `up` by its name, or the loaded profile) and the project ranks run in."""

    loaded: Any
    profile: Any
    project: Any


def capacity(profile: Any) -> int | None:
    """Most ranks the profile's cluster can ever provide, or None when it cannot be known."""
    if not hasattr(profile, "rank_capacity"):  # an address profile: someone else's cluster
        return None
    ranks: int = profile.rank_capacity()
    return ranks


def _checked_profile(profile: str | None, world_size: int | None) -> Any:
    """The profile, after checking the world size against it (BadInput naming the option)."""
    from clusterkit.errors import BadInput
    from clusterkit.profiles import load_profile
    from clusterkit.runs.search import cluster_is_up

    if profile is not None and cluster_is_up(profile):  # a cluster from `up`, by its name
        return profile
    model = load_profile(profile)
    most = capacity(model)
    if world_size is not None and most is not None and world_size > most:
        raise BadInput(
            f"--world-size {world_size} is more than profile '{model.name}' can provide "
            f"({most} ranks)"
        )
    return model


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


def prepare(spec: RunSpec) -> Training:
    """The script, the profile and the project, checked in that order (BadInput)."""
    from clusterkit.runners.ddp.script import load_target

    options: TrainOptions = spec.options  # type: ignore[assignment]
    loaded = load_target(spec.target)
    profile = _checked_profile(spec.profile, options.world_size)
    workdir = None if options.no_workdir else (options.workdir or "auto")
    return Training(loaded, profile, _project(loaded, workdir, options.workdir_max_size))


def detached(spec: RunSpec, training: Training, run_folder: Path) -> RunSpec:
    """The spec a detached run records, paths absolute. Without a checkpoint directory its
    checkpoints go to ``run_folder``, so that a restarted driver resumes from the last one
    (workers must see that path: a local or shared-disk cluster; elsewhere pass a URL).
    Failed ranks' tracebacks go whole to the run's log."""
    options: TrainOptions = spec.options  # type: ignore[assignment]

    def absolute(path: str) -> str:
        return str((Path(spec.cwd) / Path(path).expanduser()).resolve())

    checkpoints, profile, loaded = options.checkpoint_dir, spec.profile, training.loaded
    if checkpoints is None:
        checkpoints = str(run_folder / "checkpoints")
    elif "://" not in checkpoints:
        checkpoints = absolute(checkpoints)
    if profile is not None and profile.endswith((".yaml", ".yml")):
        profile = absolute(profile)
    workdir = None if options.no_workdir or options.workdir is None else options.workdir
    return spec.replaced(
        target=str(loaded.path) + (f":{loaded.function}" if loaded.function else ""),
        profile=profile,
        checkpoint_dir=checkpoints,
        tracebacks=True,
        workdir=workdir if workdir is None else absolute(workdir),
    )


def run(spec: RunSpec, training: Training, attach_timeout: float = DEFAULT_TIMEOUT) -> int:
    """The training, driven from this process; rank 0's progress on the status line, the
    ranks' results after. 130 when it was interrupted (the ranks are stopped by then).
    ``attach_timeout``: seconds to wait for the cluster's scheduler."""
    from clusterkit import console
    from clusterkit.client import get_client
    from clusterkit.runners.ddp import TrainingFailed
    from clusterkit.runners.ddp.output import Printer
    from clusterkit.runners.ddp.progress import ProgressDisplay, describe
    from clusterkit.runners.ddp.script import run_file

    options: TrainOptions = spec.options  # type: ignore[assignment]
    loaded, profile = training.loaded, training.profile
    printer = Printer(options.tracebacks or None)  # None: as CLUSTERKIT_DEBUG says
    client = get_client(profile, timeout=attach_timeout)
    try:
        on = profile if isinstance(profile, str) else profile.name
        with ProgressDisplay(f"training {loaded.path.name} on '{on}'") as display:
            printer.sink = display.write
            results = run_file(
                loaded,
                list(options.script_args),
                client=client,
                world_size=options.world_size,
                max_restarts=options.max_restarts,
                timeout=options.timeout,
                workdir=training.project,
                checkpoint_dir=options.checkpoint_dir,
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
        sys.stderr.write(f"interrupted: training {loaded.path.name} stopped\n")
        sys.stderr.flush()
        return 130
    if all(value is None for value in results):  # a torchrun-style script returns nothing
        last = f" ({describe(display.latest)})" if display.latest else ""
        console.message(f"trained {loaded.path.name}: {len(results)} ranks finished{last}")
    else:
        console.table(None, ["rank", "result"], [(r, repr(v)) for r, v in enumerate(results)])
    return 0
