"""The Backend base class (every hook declared once, with its default) and ``get_backend``
over the registry (:mod:`clusterkit.registry`, whose names this module re-exports).

A backend subclasses :class:`Backend`, names its pydantic profile model in ``Profile`` and
overrides the hooks that differ. Importing a backend module must not import its wrapped
library: that happens inside ``create`` so ``clusterkit profiles ...`` stays fast and works
without the extra installed. Third-party backends register a ``Backend`` subclass (or
instance) under the ``clusterkit.backends`` entry-point group; their ``Profile`` model then
validates their profiles.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from clusterkit import registry
from clusterkit.errors import BackendUnavailable, BadInput, CapabilityMissing
from clusterkit.registry import BUILTIN as BUILTIN
from clusterkit.registry import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from clusterkit.registry import names as names
from clusterkit.registry import profile_model as profile_model

if TYPE_CHECKING:
    from distributed import Client
    from distributed.deploy.cluster import Cluster

    from clusterkit.schema import ProfileCommon
    from clusterkit.security import ClusterSecurity
    from clusterkit.state import ClusterRecord


class Capability(enum.Enum):
    GPU = "gpu"
    UCX = "ucx"
    TLS = "tls"
    SCALE = "scale"
    ADAPT = "adapt"
    DETACHED = "detached"  # the cluster lives outside our process (Kubernetes)
    ATTACH_ONLY = "attach-only"  # nothing to start: `connect` attaches (address)
    REMOTE = "remote"  # workers run on other machines: jobs, pods, hosts someone pays for


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


class Backend:
    """What every backend is. Hooks not overridden keep the defaults below."""

    NAME: ClassVar[str]
    Profile: ClassVar[type[ProfileCommon]]
    CAPABILITIES: ClassVar[frozenset[Capability]] = frozenset()
    REQUIRES: ClassVar[tuple[Requirement, ...]] = ()

    # ------------------------------------------------------------ starting a cluster

    def render(self, profile: Any, security: ClusterSecurity) -> str:
        """Pure: what would run (job script, commands per host, manifest)."""
        raise NotImplementedError

    def identity(self, profile: Any, name: str) -> dict[str, Any]:
        """The tags the cluster's resources will carry and where they will be, chosen before
        anything exists: the claim record keeps them, so `down` can remove what a process
        killed mid-start made. A backend that returns some receives them again as
        ``create(..., identity=...)`` and must use them."""
        return {}

    def create(self, profile: Any, security: ClusterSecurity, *, name: str) -> Cluster:
        """Start the cluster (importing its library here) and return the distributed object.

        ``name`` is the cluster's name (``up --name``); every resource carries it.
        """
        raise BadInput(f"backend '{self.NAME}' starts no clusters")

    def connect(self, profile: Any, security: ClusterSecurity, *, timeout: float) -> Client:
        """ATTACH_ONLY backends: a client to a cluster that someone else runs."""
        raise BadInput(f"backend '{self.NAME}' has nothing to attach to")

    def evidence(self, cluster: Any, profile: Any) -> list[str]:
        """Why a started cluster is not running; the first line is the reason."""
        return []

    def destroy(self, cluster: Any, profile: Any) -> None:
        """Stop everything the cluster started (a failed start, an embedded cluster's end)."""
        cluster.close()

    def own(self, cluster: Any, profile: Any) -> None:
        """Make closing the cluster object stop all it started (an embedded cluster's owner).

        Clusters that run inside the owner's processes already do; DETACHED ones override.
        """

    def release(self, cluster: Any, profile: Any) -> None:
        """Let go of a DETACHED cluster's handle; the cluster keeps running."""
        cluster.close()

    def record_extra(self, cluster: Any, profile: Any) -> dict[str, Any]:
        """What the record must keep to find the cluster again (names, namespaces)."""
        return {}

    def describe(self, cluster: Any, profile: Any) -> list[StatusRow]:
        """Status rows (jobs, pods) of a cluster this process owns."""
        return []

    def doctor(self, profile: Any, security: ClusterSecurity) -> list[Check]:
        """Checks of what this backend needs, for ``clusterkit doctor``."""
        return []

    # ------------------------------------------------------------ DETACHED clusters, by record

    def attach(self, record: ClusterRecord, *, timeout: float) -> Client:
        """A client to a live record's scheduler."""
        return attach_plain(record, timeout=timeout)

    def teardown(self, record: ClusterRecord) -> None:
        """Remove what carries the record's identity, no supervisor needed: ``down`` of a
        DETACHED cluster, of a dead one, and after a supervisor stopped (what its own close
        could not reach)."""

    def scale_record(self, record: ClusterRecord, n: int) -> None:
        """``scale`` of a DETACHED cluster."""
        raise BadInput(f"backend '{self.NAME}' cannot scale")

    def describe_record(self, record: ClusterRecord) -> list[StatusRow]:
        """Status rows of a DETACHED cluster, asked of its own API."""
        return []

    def list_resources(self) -> list[dict[str, Any]]:
        """Clusters this backend can see beyond clusterkit's records (``ls --kubernetes``)."""
        raise BadInput(f"backend '{self.NAME}' has no resources to list")

    def component_logs(
        self, record: ClusterRecord, component: str | None, lines: int
    ) -> dict[str, list[str]]:
        """Logs of the backend's own parts (batch jobs: ``job ID``) for ``logs``; all of them
        when ``component`` is None, none when it names no part of this backend."""
        return {}


# ---------------------------------------------------------------------------- registry

_loaded: dict[str, Backend] = {}


def _instance(found: Any) -> Backend:
    backend = found() if isinstance(found, type) else found
    if not isinstance(backend, Backend):
        raise CapabilityMissing(f"{found!r} is not a clusterkit Backend")
    return backend


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (built-in first, then entry points)."""
    if name not in _loaded:
        _loaded[name] = _instance(registry.load(name))
    return _loaded[name]


#: Built-in backends that keep the default ``attach``: a client reaches their clusters from
#: the record alone, without importing the backend module (and, through it, the profile
#: schema). tests/test_layout.py checks this set against the classes.
PLAIN_ATTACH = frozenset(BUILTIN) - {"kubernetes"}


def attach(record: ClusterRecord, *, timeout: float) -> Client:
    """A client to a live record's scheduler, through its backend's ``attach``."""
    if record.backend in PLAIN_ATTACH:
        return attach_plain(record, timeout=timeout)
    return get_backend(record.backend).attach(record, timeout=timeout)


def attach_plain(record: ClusterRecord, *, timeout: float) -> Client:
    """The default ``attach``: a plain Client with the record's client certificates."""
    from distributed import Client

    from clusterkit.security import ClusterSecurity

    security = ClusterSecurity.from_dict(record.security).client_only()
    security.apply_env()
    return Client(
        record.address, security=security.distributed(), timeout=timeout, set_as_default=False
    )


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
    if profile.adapt_spec is not None:
        wanted.append((Capability.ADAPT, "adapt"))
    if profile.gpus_per_worker:
        wanted.append((Capability.GPU, "worker.gpus"))
    for capability, field_name in wanted:
        if capability not in backend.CAPABILITIES:
            raise CapabilityMissing(
                f"profile '{profile.name}': backend '{backend.NAME}' does not support {field_name}"
            )


def backend_for(profile: ProfileCommon) -> Backend:
    """The profile's backend, with its library present and its capabilities checked."""
    backend = get_backend(profile.backend_name)
    require(backend, profile.name)
    check_capabilities(backend, profile)
    return backend
