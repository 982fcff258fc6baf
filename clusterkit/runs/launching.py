"""Detaching a run: its spec checked against what it names, recorded in
``<state dir>/runs/ID.json`` and started away from this process (a monitor in its own session,
or one batch job). ``clusterkit hpo|train ... --detach|--batch`` and :func:`launch` both come
here."""

from __future__ import annotations

import contextlib
import io
import os
import time
from typing import TYPE_CHECKING, Any

from clusterkit import state
from clusterkit.errors import BadInput
from clusterkit.runs.records import RunRecord, new_id

if TYPE_CHECKING:
    from clusterkit.runs.spec import RunSpec


def cluster_for(profile: str | None) -> str | None:
    """The cluster from `up` a run on ``profile`` attaches to by name; None: the driver starts
    its own (embedded) cluster. A cluster supervised on another host is refused here."""
    if os.environ.get("CLUSTERKIT_SCHEDULER"):
        return None
    name = profile or os.environ.get("CLUSTERKIT_PROFILE") or "local"
    if name.endswith((".yaml", ".yml")):
        return None
    record = state.read_record(name)
    if record is None or not state.is_live(record) or record.starting:
        return None
    if record.elsewhere:
        raise BadInput(
            f"cluster '{name}' is supervised on host {record.host}: its runs run there",
            hint=f"ssh {record.host} and run the command there",
        )
    return name


def launch(
    spec: RunSpec | str,
    args: list[str] | None = None,
    *,
    max_restarts: int = 3,
    batch: bool = False,
) -> str:
    """Detach a run from Python: ``clusterkit hpo|train ... --detach`` (``--batch`` with
    ``batch``), the same checks, the run ID returned.

    ``launch(RunSpec.hpo("search.py:objective", trials=60, profile="gpu-lab"))``, or the
    command's arguments: ``launch("hpo", ["search.py:objective", "--trials", "60"])``. Bad
    input raises :class:`clusterkit.errors.BadInput` before anything is recorded.
    """
    from clusterkit.runs.execution import check_restarts
    from clusterkit.runs.process import fresh_interpreter
    from clusterkit.runs.spec import from_command_line

    if isinstance(spec, str):
        spec, given = from_command_line(spec, list(args or []))
        batch = batch or given["batch"]
    elif args is not None:
        raise BadInput("launch(spec) takes no arguments beside the spec")
    check_restarts(spec.kind, max_restarts)
    # a fresh interpreter: the caller may be long-lived (a notebook); its stdout: the user's
    quiet = contextlib.redirect_stdout(io.StringIO())
    with contextlib.chdir(spec.cwd), quiet, fresh_interpreter():
        return detach(spec, max_restarts=max_restarts, batch=batch)


def detach(spec: RunSpec, *, max_restarts: int, batch: bool, prepared: Any = None) -> str:
    """Check ``spec`` against what it names (unless ``prepared`` says it was), record it with
    every path absolute, and start it detached, or with ``batch`` as one batch job; its ID."""
    from clusterkit.runs import execution, scripted, search, training

    prepared = execution.prepare(spec) if prepared is None else prepared
    run_id = new_id(spec.kind)
    if isinstance(prepared, scripted.Script):
        recorded = scripted.detached(spec, prepared)
    elif spec.kind == "hpo":
        recorded = search.detached(spec, prepared)
    else:
        recorded = training.detached(spec, prepared, state.run_dir(run_id))
    return submit(recorded, max_restarts=max_restarts, run_id=run_id, batch=batch)


def submit(
    spec: RunSpec, *, max_restarts: int = 3, run_id: str | None = None, batch: bool = False
) -> str:
    """Record a run of ``spec`` (checked, its paths absolute) and detach it, or with ``batch``
    submit it as one batch job (:mod:`clusterkit.runs.batch`).

    Returns the run ID once its monitor runs (or its job is queued); the driver starts after.
    """
    from clusterkit.runs import batch as batch_job
    from clusterkit.runs.execution import check_restarts
    from clusterkit.runs.process import detach as detach_monitor
    from clusterkit.runs.spec import HpoOptions, command_line

    check_restarts(spec.kind, max_restarts)
    options, profile = spec.options, spec.profile
    loaded = batch_job.checked_profile(profile) if batch else None
    record = RunRecord(
        id=run_id or new_id(spec.kind),
        kind=spec.kind,
        argv=command_line(spec),
        cwd=spec.cwd,
        profile=profile or os.environ.get("CLUSTERKIT_PROFILE") or "local",
        cluster=None if batch else cluster_for(profile),
        results=options.out if isinstance(options, HpoOptions) else options.checkpoint_dir,
        max_restarts=max_restarts,
        spec=spec.model_dump(mode="json"),
    )
    state.check_space(state.run_dir(record.id))
    if loaded is not None:
        record.state, record.batch = "queued", batch_job.plan(loaded, record)
    record.save()
    try:
        if loaded is None:
            detach_monitor(record)
        else:
            _submit_batch(record, loaded)
    except BaseException as error:
        record.state, record.exit_code, record.reason = "failed", 1, str(error)[:200]
        record.ended_at = time.time()
        record.save()
        raise
    return record.id


def _submit_batch(record: RunRecord, profile: Any) -> None:
    """Certificates in the run's folder (the job's nodes share it), then the job."""
    from clusterkit import security
    from clusterkit.runs import batch as batch_job

    if profile.protocol == "tls":
        security.generate_tls(state.run_dir(record.id) / batch_job.TLS_DIR)
    batch_job.submit_job(record, profile)
