"""Ending what a dead or half-visible cluster left: reaping by tags, stopping by pid file,
and rewriting an unreadable record from what its supervisor knows."""

from __future__ import annotations

import logging

from clusterkit import state
from clusterkit.backends.base import get_backend
from clusterkit.errors import ClusterkitError
from clusterkit.state import ClusterRecord

logger = logging.getLogger(__name__)


def recovered(unreadable: state.Unreadable) -> ClusterRecord:
    """Ask the supervisor for the record it wrote, and write it again; else say what runs."""
    from clusterkit.lifecycle import control

    socket = state.control_socket(unreadable.name)
    try:
        record = ClusterRecord(
            **control.request(str(socket), {"op": "record"}, timeout=10)["record"]
        )
    except (OSError, TypeError, ClusterkitError):
        pid = state.supervisor_pid(unreadable.name)
        runs = f"its supervisor (pid {pid}) still runs" if pid else "no supervisor runs for it"
        raise ClusterkitError(
            f"the record of '{unreadable.name}' is unreadable "
            f"({unreadable.path}: {unreadable.reason}); {runs}",
            hint=f"`clusterkit down {unreadable.name}` stops it and removes the record",
        ) from None
    state.write_record(record)
    return record


def unclaimed(claim: ClusterRecord) -> None:
    """A claim nobody withdrew: its process died mid-start (a clean failure tears down and
    withdraws). Remove what carries its identity; the start's own error is what the user sees."""
    try:
        get_backend(claim.backend).teardown(claim)
    except Exception as error:
        logger.warning("cleaning up after the failed start of '%s': %s", claim.name, error)


def reap(record: ClusterRecord) -> None:
    """Remove what a dead supervisor left: its process group and whatever carries its tags."""
    with state.lock(record.name):
        reap_held(record)


def reap_held(record: ClusterRecord) -> None:
    """``reap`` with the name's lock already held."""
    from clusterkit.lifecycle.spawn import kill_group

    if record.pid is not None:
        kill_group(record.pid, grace=3.0)
    get_backend(record.backend).teardown(record)
    state.remove_cluster(record.name)


def down_by_pid_file(name: str, timeout: float) -> None:
    from clusterkit.lifecycle.spawn import stop_supervisor

    found = state.pid_file(name)
    if found is not None and found[1] != state.HOST:
        raise ClusterkitError(
            f"cluster '{name}' is supervised on host {found[1]}: only there can it be stopped",
            hint=f"ssh {found[1]} clusterkit down {name}",
        )
    with state.lock(name):
        pid = state.supervisor_pid(name)
        if pid is not None:
            stop_supervisor(pid, timeout)
        claim = state.read_record(name)  # a supervisor stopped mid-start: what it claimed
        if claim is not None:
            get_backend(claim.backend).teardown(claim)
        state.remove_cluster(name)
