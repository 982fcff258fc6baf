"""``get_client()``: worker context > CLUSTERKIT_SCHEDULER > live record > embedded cluster."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput

if TYPE_CHECKING:
    from distributed import Client

    from clusterkit.state import ClusterRecord

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
#: Seconds of the first connection attempt to a supervised cluster (the rest of the timeout
#: follows unless the connection was refused).
FIRST_ATTEMPT = 2.0
#: Seconds between checks that the cluster of a client that lost its scheduler still exists.
WATCH_EVERY = 0.5
_QUIET_AT_EXIT = False
#: the web secret's file of the clusters this process's clients reach (by `up` or embedded)
_WEB_TOKENS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
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
            if record.starting:
                from clusterkit.errors import ClusterNotFound

                raise ClusterNotFound(
                    f"cluster '{name}' is still starting (pid {record.pid or record.owner})",
                    hint="call get_client again once its `clusterkit up` has finished",
                )
            return connect(record, timeout=timeout)

    _cluster, client = _embedded(profile, timeout)
    return client


def connect(record: ClusterRecord, *, timeout: float = 30) -> Client:
    """A plain Client to a live record's scheduler (re-attaching DETACHED backends).

    A supervised cluster's scheduler never comes back at its address once it is gone: one that
    refuses the connection raises ClusterNotFound at once, instead of distributed retrying for
    the whole ``timeout``. The client stops reconnecting once the record is gone or dead.
    """
    import time

    from clusterkit.backends.base import attach

    if record.pid is None:  # Kubernetes restarts a scheduler behind the same address
        client = attach(record, timeout=timeout)
    else:
        began = time.monotonic()
        try:
            client = attach(record, timeout=min(FIRST_ATTEMPT, timeout))
        except OSError:
            left = timeout - (time.monotonic() - began)
            if _refuses(record.address):
                from clusterkit.errors import ClusterNotFound

                raise ClusterNotFound(
                    f"cluster '{record.name}' does not answer: its scheduler at "
                    f"{record.address} refuses connections",
                    hint=f"`clusterkit down {record.name}` removes what is left of it",
                ) from None
            if left <= 0:
                raise
            client = attach(record, timeout=left)  # a slow scheduler: the rest of the time
    _stop_reconnecting_when_gone(client, record)
    _remember_token(client, record.security.get("web_token_file"))
    return client


def _remember_token(client: Client, token_file: str | None) -> None:
    if token_file:
        _WEB_TOKENS[client] = token_file


def dashboard_link(client: Client | None = None) -> str | None:
    """The Dask dashboard of ``client``'s cluster (default: the current client) as a link
    that carries the cluster's web secret once: the page it opens keeps it in a cookie. None
    for a cluster without a dashboard."""
    from distributed import default_client

    from clusterkit.webauth import link

    client = client if client is not None else default_client()
    return link(getattr(client, "dashboard_link", None), _WEB_TOKENS.get(client))


def _refuses(address: str) -> bool:
    """Whether nothing listens at a scheduler's TCP address: a bare connection is refused."""
    import socket

    from distributed.comm.addressing import get_address_host_port

    try:
        socket.create_connection(get_address_host_port(address), timeout=FIRST_ATTEMPT).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):  # unreachable for now, or not a TCP address
        return False
    return False


def _stop_reconnecting_when_gone(client: Client, record: ClusterRecord) -> None:
    """A client that lost its scheduler retries for its whole timeout; once the cluster's record
    is gone or dead (`down`, a supervisor killed) there is nothing to come back: close it, so
    whoever waits on it (a search, ``scale``) hears at once."""
    import time

    from clusterkit import state

    reference = weakref.ref(client)

    def gone() -> bool:
        current = state.read_record(record.name)
        return current is None or current.address != record.address or not state.is_live(current)

    def watch() -> None:
        while (watched := reference()) is not None and watched.status != "closed":
            if watched.status == "connecting" and gone():
                with contextlib.suppress(Exception):
                    watched.close()
                return
            del watched
            time.sleep(WATCH_EVERY)

    threading.Thread(target=watch, daemon=True, name=f"watch-{record.name}").start()


def _embedded(profile_ref: ProfileRef, timeout: float) -> tuple[Any, Client]:
    """Start the profile's cluster in this process and a client that owns it."""
    from distributed import Client

    from clusterkit.backends.base import Capability, backend_for
    from clusterkit.lifecycle.start import Claim, start_cluster
    from clusterkit.profiles import load_profile
    from clusterkit.security import exposure, prepare

    profile = load_profile(profile_ref)
    backend = backend_for(profile)
    if Capability.ATTACH_ONLY in backend.CAPABILITIES:  # nothing to start, only attach
        return None, backend.connect(profile, prepare(profile, None), timeout=timeout)
    name = f"{profile.name}-{os.getpid()}"
    remote = Capability.REMOTE in backend.CAPABILITIES
    directory = _certificate_dir(name, remote)  # its certificates (TLS) and web secret
    claim = Claim(profile, name) if remote else None  # found by `ls` if this process dies
    try:
        started = start_cluster(profile, name=name, security_dir=directory, claim=claim)
        try:
            client = Client(
                started.cluster, security=started.security.distributed(), timeout=timeout
            )
        except BaseException:
            started.close()
            raise
    except BaseException:
        if directory is not None:
            _remove_tree(directory)
        if claim is not None:
            claim.withdraw()
        raise
    _own(client, started, directory)
    _remember_token(client, started.security.web_token_file)
    _quiet_scheduler_at_exit()
    notice = exposure(profile.protocol, started.address)
    if notice:
        logger.warning("%s", notice)
    if remote:
        _record_embedded(client, started)
        logger.warning(
            "started an embedded %s cluster '%s' (%d workers); it ends with this process. "
            "`clusterkit up %s` keeps one running that get_client('%s') attaches to",
            profile.backend_name,
            name,
            len(started.cluster.scheduler_info.get("workers", {})),
            profile.name,
            profile.name,
        )
    return started.cluster, client


def _certificate_dir(name: str, remote: bool) -> Path:
    """A private directory for an embedded cluster's certificates: a fresh temporary one, or,
    for workers on other machines, one in the state directory (which those machines share)."""
    if not remote:
        return Path(tempfile.mkdtemp(prefix="clusterkit-tls-"))
    from clusterkit import state

    return state.cluster_dir(name) / "tls"


def _own(client: Client, started: Any, directory: Path | None) -> None:
    """Make ``client`` own the cluster as ``Client()`` owns its implicit LocalCluster.

    distributed has no public way to hand a client its cluster: it closes ``client.cluster``
    on ``close()`` only when the client was started without an address, which it remembers in
    ``_start_arg``. Setting that gives the same behaviour; the finalizer then stops what the
    backend started (for Kubernetes, deletes the DaskCluster), also when the client is never
    closed and the process exits. The client closes the cluster inside the cluster's event
    loop, where distributed leaves the cluster's own hold on that loop: it is let go here, so
    the client's close ends the loop thread (else the garbage collector did, from whatever
    thread collected, under distributed's class-wide ``LoopRunner`` lock: a cluster starting
    in another thread then waited 10 s and failed).
    """
    client._start_arg = None
    runner = getattr(started.cluster, "_loop_runner", None)
    if runner is not None and not client.asynchronous:
        runner.stop()  # the client's hold keeps the loop running until it closes
    started.backend.own(started.cluster, started.profile)
    weakref.finalize(client, _close_quietly, started)
    if directory is not None:
        weakref.finalize(client, _remove_tree, directory)


def _record_embedded(client: Client, started: Any) -> None:
    """A record for an embedded cluster on other machines: if this process dies without
    closing it, `clusterkit ls --orphans` finds its jobs, pods or processes and `down` ends
    them. It goes when the client does."""
    from clusterkit import state

    record = started.record(pid=None)
    record.owner = os.getpid()
    state.write_record(record)
    weakref.finalize(client, state.remove_cluster, record.name)


def _close_quietly(started: Any) -> None:
    """The client's finalizer: stop what the backend started. The garbage collector may run it
    on a thread inside distributed's class-wide ``LoopRunner`` lock (a cluster starting), which
    closing takes: then it closes on a thread of its own, once that thread lets go."""
    from distributed.utils import LoopRunner

    lock = getattr(LoopRunner, "_lock", None)
    if lock is not None and lock.locked():
        threading.Thread(target=_close_now, args=(started,), name="clusterkit-close").start()
    else:
        _close_now(started)


def _close_now(started: Any) -> None:
    with contextlib.suppress(Exception):
        started.close()


def _quiet_scheduler_at_exit() -> None:
    """At interpreter exit an embedded cluster stops with the script; its scheduler's warnings
    about results lost with the workers (futures the script still held) are noise then. This
    runs before distributed's own exit hooks, which were registered first."""
    global _QUIET_AT_EXIT
    if _QUIET_AT_EXIT:
        return
    import atexit

    atexit.register(logging.getLogger("distributed.scheduler").setLevel, logging.ERROR)
    _QUIET_AT_EXIT = True


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
            with contextlib.suppress(Exception):
                cluster_object.close()
