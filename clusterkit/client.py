"""``get_client()``: worker context > CLUSTERKIT_SCHEDULER > live record > embedded cluster."""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput, ClusterStartError

if TYPE_CHECKING:
    from distributed import Client

    from clusterkit.state import ClusterRecord

DEFAULT_TIMEOUT = 30.0
ProfileRef = Any  # a profile name, a path to a profile file, a loaded profile, or None


def _worker_client() -> Client | None:
    """The worker's own client when called inside a Dask task, else None."""
    try:
        from distributed import get_worker
        from distributed.worker import get_client as worker_get_client

        get_worker()
    except (ImportError, ValueError):
        return None
    return worker_get_client()


def _security_from_env(protocol_hint: str) -> Any:
    """TLS files from CLUSTERKIT_SECURITY: a directory (ca.pem, cert.pem, key.pem) or 3 paths."""
    spec = os.environ.get("CLUSTERKIT_SECURITY")
    if not spec:
        if protocol_hint == "tls":
            raise BadInput(
                "CLUSTERKIT_SCHEDULER is a tls:// address but CLUSTERKIT_SECURITY is not set",
                hint="point it at a directory holding ca.pem, cert.pem and key.pem",
            )
        return None
    from clusterkit.security import ClusterSecurity

    if os.path.isdir(spec):
        ca, cert, key = (str(Path(spec) / n) for n in ("ca.pem", "cert.pem", "key.pem"))
    else:
        parts = spec.split(",")
        if len(parts) != 3:
            raise BadInput(f"CLUSTERKIT_SECURITY={spec!r} is neither a directory nor CA,CERT,KEY")
        ca, cert, key = parts
    for file in (ca, cert, key):
        if not os.path.isfile(file):
            raise BadInput(f"CLUSTERKIT_SECURITY names {file!r}, which does not exist")
    return ClusterSecurity.from_files(ca, cert, key).distributed()


def _profile_name(ref: ProfileRef) -> str | None:
    """The record name a reference can be looked up by without loading the profile."""
    if hasattr(ref, "backend_name"):  # a loaded profile (checked without importing pydantic)
        return str(ref.name)
    if ref is None:
        return os.environ.get("CLUSTERKIT_PROFILE") or "local"
    text = os.fspath(ref)
    return None if text.endswith((".yaml", ".yml")) else text


def get_client(profile: ProfileRef = None, *, timeout: float = DEFAULT_TIMEOUT) -> Client:
    """A plain ``distributed.Client`` for the profile.

    Resolution, first that applies: inside a Dask task, the worker's client;
    ``CLUSTERKIT_SCHEDULER`` (with ``CLUSTERKIT_SECURITY`` for TLS); a live cluster started by
    ``clusterkit up`` under the profile's name; otherwise an embedded cluster built from the
    profile, owned by this process and closed when the client closes or the process exits.

    Parameters
    ----------
    profile
        Name, path, or loaded profile; default ``$CLUSTERKIT_PROFILE``, else ``local``.
    timeout
        Seconds to wait for the scheduler connection.
    """
    client = _worker_client()
    if client is not None:
        return client
    from distributed import Client

    address = os.environ.get("CLUSTERKIT_SCHEDULER")
    if address:
        scheme = address.split("://", 1)[0] if "://" in address else "tcp"
        return Client(address, security=_security_from_env(scheme), timeout=timeout)

    name = _profile_name(profile)
    if name is not None:
        from clusterkit import state

        record = state.read_record(name)
        if record is not None and state.is_live(record):
            return connect(record, timeout=timeout)

    _cluster, client = _embedded(profile, timeout)
    return client


def connect(record: ClusterRecord, *, timeout: float = 30) -> Client:
    """A plain Client to a live record's scheduler (re-attaching DETACHED backends)."""
    from clusterkit.backends.base import get_backend
    from clusterkit.security import ClusterSecurity

    security = ClusterSecurity.from_dict(record.security)
    security.apply_env()
    if record.pid is None:
        attach = getattr(get_backend(record.backend), "attach", None)
        if attach is not None:
            return attach(record)  # type: ignore[no-any-return]
    from distributed import Client

    return Client(
        record.address, security=security.distributed(), timeout=timeout, set_as_default=False
    )


def _embedded(profile_ref: ProfileRef, timeout: float) -> tuple[Any, Client]:
    """Start the profile's cluster in this process and a client that owns it."""
    from distributed import Client

    from clusterkit.api import backend_for, security_hostnames
    from clusterkit.lifecycle.supervisor import wait_for_workers
    from clusterkit.profiles import load_profile
    from clusterkit.security import prepare

    profile = load_profile(profile_ref)
    backend = backend_for(profile)
    connect = getattr(backend, "connect", None)
    if connect is not None:  # an address profile: nothing to start, only attach
        return None, connect(profile, prepare(profile, None), timeout)
    directory = None
    if profile.protocol == "tls":
        directory = Path(tempfile.mkdtemp(prefix="clusterkit-tls-"))
    security = prepare(profile, directory, security_hostnames(profile))
    security.apply_env()
    import time

    deadline = time.monotonic() + profile.start_timeout
    cluster: Any = backend.create_cluster(profile, security)
    try:
        wait_for_workers(cluster, int(getattr(profile, "min_workers", 0)), deadline)
        adapt = getattr(profile, "adapt", None)
        if adapt is not None:
            cluster.adapt(minimum=adapt.minimum, maximum=adapt.maximum)
        client = Client(cluster, security=security.distributed(), timeout=timeout)
    except BaseException as error:
        cluster.close()
        if isinstance(error, ClusterStartError):
            hook = getattr(backend, "evidence", None)
            error.evidence = (hook(cluster, profile) if hook else []) or error.evidence
        raise
    # The client owns the cluster exactly as `Client()` owns its implicit LocalCluster:
    # distributed closes `client.cluster` on `client.close()` when the start argument was None.
    client._start_arg = None
    weakref.finalize(client, _close_quietly, cluster)
    if directory is not None:
        weakref.finalize(client, _remove_tree, directory)
    return cluster, client


def _close_quietly(cluster: Any) -> None:
    with contextlib.suppress(Exception):
        cluster.close()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def cluster(
    profile: ProfileRef = None, *, timeout: float = DEFAULT_TIMEOUT
) -> Iterator[tuple[Any, Client]]:
    """``with clusterkit.cluster("local") as (cluster, client):`` an embedded cluster."""
    cluster_object, client = _embedded(profile, timeout)
    try:
        yield cluster_object, client
    finally:
        client.close()
        if cluster_object is not None:
            _close_quietly(cluster_object)
