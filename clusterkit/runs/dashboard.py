"""What `clusterkit runs dashboard ID` serves: a search's storage and study, and its cluster."""

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
    storage, name = _option(record.argv, "--storage"), _option(record.argv, "--study-name")
    if storage is None or name is None:
        raise BadInput(f"run '{run_id}' records no --storage and --study-name")
    cluster = state.read_record(record.cluster) if record.cluster else None
    return RunStudy(storage, name, cluster)
