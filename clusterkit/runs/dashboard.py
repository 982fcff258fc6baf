"""What `clusterkit runs dashboard ID` serves: a search's storage and study, and its cluster;
and the dashboard a search serves while it runs (``hpo --dashboard``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterkit import state
from clusterkit.errors import BadInput
from clusterkit.runs.records import get


@dataclass
class RunStudy:
    """Where a detached search keeps its study, and the cluster from `up` it runs on."""

    storage: str  # a database URL or an absolute journal file path
    study_name: str
    cluster: Any  # the cluster's record; None: a cluster of the run's own (no record)


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def study_of(run_id: str) -> RunStudy:
    """The study of search ``run_id``; BadInput for a training or a record without one."""
    record = get(run_id)
    if record.kind != "hpo":
        raise BadInput(f"run '{run_id}' is a {record.kind} run: only searches have a study")
    if record.spec is not None:  # as recorded; a record from before specs: its arguments
        options = record.spec.get("options", {})
        storage, name = options.get("storage"), options.get("study_name")
    else:
        storage, name = _option(record.argv, "--storage"), _option(record.argv, "--study-name")
    if storage is None or name is None:
        raise BadInput(f"run '{run_id}' records no --storage and --study-name")
    cluster = state.read_record(record.cluster) if record.cluster else None
    return RunStudy(storage, name, cluster)


class _NoDashboard:
    def close(self) -> None:
        pass


def search_dashboard(enabled: bool, storage: Any, name: str, client: Any, profile: Any) -> Any:
    """`hpo --dashboard`: the study's dashboard served (its links on stderr) until ``close()``;
    without the flag, nothing to close."""
    if not enabled:
        return _NoDashboard()
    from clusterkit import console
    from clusterkit.runners.hpo import dashboard as study_dashboard

    named = profile and "/" not in profile and not profile.endswith((".yaml", ".yml"))
    cluster = state.read_record(profile) if named else None  # a cluster from `up`, if live
    if cluster is not None and not state.is_live(cluster):
        cluster = None
    view = study_dashboard.serve(storage, name)
    for line in study_dashboard.links(view, cluster=cluster, client=client):
        console.message(line)
    return view
