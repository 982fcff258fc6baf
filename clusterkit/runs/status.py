"""How a run's state reads to the user: its record, and what became of its monitor, its
cluster or its batch job. Above both ``records`` and ``batch`` (which asks the batch queue)."""

from __future__ import annotations

from clusterkit import state
from clusterkit.runs.records import RunRecord


def shown_state(record: RunRecord) -> str:
    """The state as the user should see it: a run whose monitor or cluster is gone says so."""
    if record.final:
        failed = record.state == "failed" and record.reason
        return f"{record.state} ({record.reason})" if failed else record.state
    if record.batch is not None:
        from clusterkit.runs.batch import job_state

        return job_state(record)
    if record.elsewhere:
        return f"{record.state} on host {record.host}"
    if record.monitor_pid is None:
        return record.state
    if not state.pid_alive(record.monitor_pid):
        return f"lost: its monitor (pid {record.monitor_pid}) is gone"
    if record.cluster is not None:
        cluster = state.read_record(record.cluster)
        if cluster is None or not state.is_live(cluster):
            return f"cluster gone: '{record.cluster}' is no longer up"
    return record.state
