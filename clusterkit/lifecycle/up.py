"""``up``: a cluster that outlives this process, owned by a detached supervisor (or, for a
DETACHED backend, by its API server)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from clusterkit import state
from clusterkit.backends.base import Capability, backend_for
from clusterkit.errors import BadInput, ClusterExists
from clusterkit.lifecycle import reap
from clusterkit.searchpath import check_name
from clusterkit.state import ClusterRecord

if TYPE_CHECKING:
    from clusterkit.lifecycle.warm import WarmSupervisor
    from clusterkit.schema import ProfileCommon


def up(
    profile_ref: str | os.PathLike[str] | ProfileCommon | None = None,
    *,
    name: str | None = None,
    waiting: contextlib.AbstractContextManager[Any] | None = None,
) -> ClusterRecord:
    """Start a cluster that outlives this process and return its record.

    A detached supervisor owns the cluster (a DETACHED backend, Kubernetes, needs none: the
    cluster lives in the API server). Raises ClusterExists if ``name`` is already up, and
    ClusterStartError with evidence if the workers do not arrive in time; then nothing is
    left running. ``waiting`` (e.g. a spinner) is entered while the cluster starts.
    """
    from clusterkit.lifecycle.warm import WarmSupervisor

    # forked before anything else, so that it imports while this process reads the profile
    warm = WarmSupervisor.fork()
    try:
        return _up(profile_ref, name, waiting, warm)
    finally:
        if warm is not None:
            warm.cancel()  # unless it took the job: then it is the cluster's supervisor


def _up(
    profile_ref: str | os.PathLike[str] | ProfileCommon | None,
    name: str | None,
    waiting: contextlib.AbstractContextManager[Any] | None,
    warm: WarmSupervisor | None,
) -> ClusterRecord:
    from clusterkit.profiles import load_profile  # here: `ls`, `down`, `status` load none

    profile = load_profile(profile_ref)
    name = name or profile.name
    check_name(name)
    backend = backend_for(profile)
    if Capability.ATTACH_ONLY in backend.CAPABILITIES:
        raise BadInput(
            f"profile '{profile.name}' attaches to a running scheduler; there is nothing to start",
            hint=f"use get_client('{profile.name}') or `clusterkit status` on the owner's side",
        )
    with state.starting(name):
        existing = state.read_record(name)
        if existing is not None:
            if state.is_live(existing):
                raise ClusterExists(
                    f"cluster '{name}' is already up at {existing.address}",
                    hint=f"`clusterkit down {name}` first, or pick another --name",
                )
            reap.reap_held(existing)  # a dead cluster of this name: reap what it left first
        try:
            state.check_space(state.cluster_dir(name))
            waiting = waiting or contextlib.nullcontext()
            if Capability.DETACHED in backend.CAPABILITIES:
                if warm is not None:
                    warm.cancel()  # the cluster lives in its API server: no supervisor
                with waiting:
                    return _up_detached(profile, name)
            from clusterkit.lifecycle import spawn

            return spawn.supervise(profile, name, state.cluster_dir(name), waiting, warm)
        except BaseException:
            leftover = state.read_record(name)
            if leftover is not None and leftover.starting:
                reap.unclaimed(leftover)
            if leftover is None or leftover.starting:
                state.remove_cluster(name)
            raise


def _up_detached(profile: ProfileCommon, name: str) -> ClusterRecord:
    """Start a cluster that lives in its own API server: record it, let go of the handle.

    A claim is recorded first, so that an `up` killed mid-start leaves a dead record that
    `down` tears down, not resources no command knows of."""
    from clusterkit.lifecycle.start import Claim, start_cluster

    claim = Claim(profile, name)
    try:
        started = start_cluster(
            profile, name=name, security_dir=state.cluster_dir(name), claim=claim
        )
    except BaseException:
        claim.withdraw()
        raise
    try:
        record = started.record(pid=None)
        state.write_record(record)
    except BaseException:
        started.close()
        raise
    started.release()
    return record
