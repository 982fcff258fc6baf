"""The Backend protocol, its capabilities, and a lazy registry (built-ins + entry points).

A backend is a module (or any object) exporting the names below. Importing a backend module
must not import its wrapped library: that happens inside ``create_cluster`` so that
``clusterkit profiles ...`` stays fast and works without the extra installed.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from clusterkit.errors import BackendUnavailable, CapabilityMissing

if TYPE_CHECKING:
    from distributed.deploy.cluster import Cluster

    from clusterkit.schema import ProfileCommon
    from clusterkit.security import ClusterSecurity


class Capability(enum.Enum):
    GPU = "gpu"
    UCX = "ucx"
    TLS = "tls"
    SCALE = "scale"
    ADAPT = "adapt"
    DETACHED = "detached"  # the cluster lives outside our process (Kubernetes)


@dataclass(frozen=True)
class Requirement:
    """A library a backend needs, and the extra that installs it."""

    module: str
    package: str
    extra: str


@dataclass
class Check:
    """One row of ``clusterkit doctor``."""

    name: str
    ok: bool
    detail: str = ""
    fix: str = ""


@dataclass
class StatusRow:
    """A backend-specific status line (a batch job, a pod) shown by ``clusterkit status``."""

    kind: str
    name: str
    state: str
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """What a backend module exports."""

    NAME: str
    CAPABILITIES: frozenset[Capability]
    REQUIRES: Sequence[Requirement]

    def render(self, profile: ProfileCommon, security: ClusterSecurity) -> str:
        """Pure: what would run (job script, commands per host, manifest)."""
        ...

    def create_cluster(self, profile: ProfileCommon, security: ClusterSecurity) -> Cluster:
        """Start the cluster (imports its library lazily) and return the distributed object."""
        ...


# Optional hooks a backend module may also define (looked up with getattr):
#   doctor(profile, security) -> list[Check]
#   describe(cluster, profile) -> list[StatusRow]      status rows (jobs, pods)
#   evidence(cluster, profile) -> list[str]            last log lines when start fails
#   attach(record) -> Client                           re-attach a DETACHED cluster
#   teardown(record) -> None                           `down` of a DETACHED cluster

BUILTIN: dict[str, str] = {
    "local": "clusterkit.backends.local:LOCAL",
    "local-cuda": "clusterkit.backends.local:LOCAL_CUDA",
    "ssh": "clusterkit.backends.ssh.backend:BACKEND",
    "slurm": "clusterkit.backends.jobqueue.backend:SLURM",
    "pbs": "clusterkit.backends.jobqueue.backend:PBS",
    "kubernetes": "clusterkit.backends.kubernetes.backend:BACKEND",
    "address": "clusterkit.backends.address:BACKEND",
}

ENTRY_POINT_GROUP = "clusterkit.backends"

_loaded: dict[str, Backend] = {}


def _load_ref(ref: str) -> Backend:
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module  # type: ignore[return-value]


def _entry_points() -> dict[str, Callable[[], Any]]:
    from importlib.metadata import entry_points

    return {ep.name: ep.load for ep in entry_points(group=ENTRY_POINT_GROUP)}


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (built-in first, then entry points)."""
    if name in _loaded:
        return _loaded[name]
    if name in BUILTIN:
        backend = _load_ref(BUILTIN[name])
    else:
        third_party = _entry_points()
        if name not in third_party:
            known = ", ".join(sorted({*BUILTIN, *third_party}))
            raise CapabilityMissing(f"no backend named '{name}'", hint=f"known: {known}")
        backend = third_party[name]()
    _loaded[name] = backend
    return backend


def names() -> list[str]:
    return sorted({*BUILTIN, *_entry_points()})


def require(backend: Backend, profile_name: str) -> None:
    """Raise BackendUnavailable if a library the backend needs is missing."""
    from importlib.util import find_spec

    for req in backend.REQUIRES:
        try:
            found = find_spec(req.module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise BackendUnavailable(profile_name, req.package, req.extra)


def check_capabilities(backend: Backend, profile: ProfileCommon) -> None:
    """Refuse, before anything starts, a profile that asks what the backend cannot do."""
    wanted: list[tuple[Capability, str]] = []
    if profile.protocol == "ucx":
        wanted.append((Capability.UCX, "protocol: ucx"))
    if profile.protocol == "tls":
        wanted.append((Capability.TLS, "protocol: tls"))
    if getattr(profile, "adapt", None) is not None:
        wanted.append((Capability.ADAPT, "adapt"))
    worker = getattr(profile, "worker", None)
    if worker is not None and worker.gpus:
        wanted.append((Capability.GPU, "worker.gpus"))
    for capability, field_name in wanted:
        if capability not in backend.CAPABILITIES:
            raise CapabilityMissing(
                f"profile '{profile.name}': backend '{backend.NAME}' does not support {field_name}"
            )
