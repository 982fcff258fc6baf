"""A run spec executed in this process: what ``clusterkit hpo|train`` does in a terminal and
what a detached run's driver does (:func:`driver_main`, with the CLI's error boundary).

``execute(RunSpec.hpo("search.py:objective", trials=20))`` searches from this process and
prints what ``clusterkit hpo`` prints; its exit status is returned, errors are raised.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from clusterkit.client import DEFAULT_TIMEOUT
from clusterkit.errors import BadInput, ClusterkitError

if TYPE_CHECKING:
    from clusterkit.runs.records import RunRecord
    from clusterkit.runs.spec import RunSpec


#: Seconds a detached run's driver waits for its cluster's scheduler. Nobody watches it, and a
#: failed start costs the whole run, so it waits longer than a terminal's get_client (30 s): a
#: Kubernetes API server under load took more than 30 s to hand the scheduler's Service over.
DRIVER_ATTACH_TIMEOUT = 180.0


def prepare(spec: RunSpec) -> Any:
    """What the spec names, loaded and checked before anything starts (BadInput): the
    objective and storage of a search, the script and profile of a training, the project."""
    if spec.kind == "hpo":
        from clusterkit.runs import scripted, search
        from clusterkit.runs.spec import is_script

        return (scripted if is_script(spec.target) else search).prepare(spec)
    from clusterkit.runs import training

    return training.prepare(spec)


def execute(spec: RunSpec, prepared: Any = None, *, attach_timeout: float = DEFAULT_TIMEOUT) -> int:
    """Run ``spec`` from this process, showing what the CLI shows; its exit status (0, or
    130 for an interrupted training). Errors are raised (ClusterkitError, KeyboardInterrupt).
    ``prepared``: :func:`prepare`'s result, when the caller has it already;
    ``attach_timeout``: seconds to wait for the cluster's scheduler."""
    prepared = prepare(spec) if prepared is None else prepared
    if spec.kind == "hpo":
        from clusterkit.runs import scripted, search

        if isinstance(prepared, scripted.Script):
            return scripted.run(spec, prepared, attach_timeout)
        return search.run(spec, prepared, attach_timeout)
    from clusterkit.runs import training

    return training.run(spec, prepared, attach_timeout)


def recorded_spec(record: RunRecord) -> RunSpec:
    """The spec a run recorded; a record from before specs: its arguments, read as
    ``clusterkit KIND ARGS`` reads them, in its directory."""
    from clusterkit.runs import spec as run_spec

    if record.spec is not None:
        return run_spec.load(record.spec)
    return run_spec.from_command_line(record.kind, record.argv, cwd=record.cwd)[0]


def driver_main(record: RunRecord) -> int:
    """A detached run's driver: its spec executed here, the exit status returned. Errors are
    shown as the CLI shows them (``error: ...``; ``CLUSTERKIT_DEBUG=1``: the traceback)."""
    from clusterkit import console

    try:
        return execute(recorded_spec(record), attach_timeout=DRIVER_ATTACH_TIMEOUT)
    except ClusterkitError as error:
        if os.environ.get("CLUSTERKIT_DEBUG"):
            raise
        console.print_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def check_restarts(kind: str, max_restarts: int) -> None:
    """A detached run's driver restarts: 0 or more (BadInput naming the command's flag)."""
    from clusterkit.runs.spec import DETACH_FLAGS

    if max_restarts < 0:
        raise BadInput(f"{DETACH_FLAGS[kind]} must be 0 or more, got {max_restarts}")
