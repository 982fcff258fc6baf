"""Records of clusters started by ``up``: atomic JSON files (0600) in a 0700 state directory."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clusterkit.errors import ClusterExists, StateError


def state_dir() -> Path:
    """``$CLUSTERKIT_STATE_DIR``, else the platform's user state directory (0700 once made).

    Reading creates nothing; the first write (a lock, a record) creates it.

    On Linux that is ``$XDG_STATE_HOME/clusterkit`` (``~/.local/state/clusterkit``); on macOS
    ``~/Library/Application Support/clusterkit``.
    """
    root = os.environ.get("CLUSTERKIT_STATE_DIR")
    if root:
        path = Path(root)
    else:
        from platformdirs import user_state_path

        path = user_state_path("clusterkit", appauthor=False)
    return path


def _made_clusters_dir() -> Path:
    """The clusters directory, created 0700 (with the state directory) if missing."""
    path = state_dir()
    with writable(path):
        for directory in (path, path / "clusters"):
            _private_dir(directory)
    return path / "clusters"


def _private_dir(path: Path) -> None:
    """Create ``path`` 0700 if missing; tighten it if it is not (a read-only one is left)."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o777 != 0o700:
        os.chmod(path, 0o700)


@contextlib.contextmanager
def writable(path: Path) -> Iterator[None]:
    """Turn an OS error on the state directory into one line that names it and the fix."""
    try:
        yield
    except OSError as error:
        raise StateError(
            f"state directory {path}: {error.strerror or error}",
            hint="free space or permissions there, or set CLUSTERKIT_STATE_DIR elsewhere",
        ) from None


#: Bytes a cluster's directory must take before anything starts (record, logs, certificates).
SPACE_PROBE = 64 * 1024


def check_space(directory: Path) -> None:
    """Write and sync a probe file: a full or read-only state disk fails here, in one line,
    before any process starts (a supervisor could not even log why it stopped)."""
    probe = directory / ".space-probe"
    with writable(directory):
        try:
            with open(probe, "wb") as handle:
                handle.write(b"\0" * SPACE_PROBE)
                handle.flush()
                os.fsync(handle.fileno())
        finally:
            probe.unlink(missing_ok=True)


def clusters_dir() -> Path:
    return state_dir() / "clusters"


def cluster_dir(name: str) -> Path:
    """The private directory of one cluster: certificates, logs, pid file."""
    path = _made_clusters_dir() / name
    with writable(path):
        _private_dir(path)
    return path


PID_FILE = "supervisor.pid"
HOST = socket.gethostname()


def runtime_dir() -> Path:
    """This user's private directory for sockets on the local disk: ``$XDG_RUNTIME_DIR`` (else
    the temp directory) ``/clusterkit-UID``. The state directory may be on a network file
    system (an NFS home), where a Unix socket cannot be made or is only valid on one host."""
    import tempfile

    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"clusterkit-{os.getuid()}"
    with writable(path):
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise StateError(
            f"runtime directory {path} is not private to this user "
            f"(owner uid {info.st_uid}, mode {info.st_mode & 0o777:o})",
            hint="remove it, or set XDG_RUNTIME_DIR to a directory only you can use",
        )
    return path


def control_socket(name: str) -> Path:
    """Where the supervisor of ``name`` (under this state directory) listens, on this host."""
    import hashlib

    key = hashlib.sha256(f"{state_dir().resolve()}\0{name}".encode()).hexdigest()[:20]
    return runtime_dir() / f"{key}.sock"


def record_path(name: str) -> Path:
    return clusters_dir() / f"{name}.json"


@dataclass
class ClusterRecord:
    """What `up` leaves behind so that any process can find and reach the cluster."""

    name: str
    backend: str
    profile: str
    profile_source: str | None
    digest: str
    address: str
    dashboard: str | None
    pid: int | None  # the supervisor; None for DETACHED backends
    security: dict[str, Any]
    min_workers: int
    started_at: float = field(default_factory=time.time)
    control: str | None = None  # supervisor's control socket
    owner: int | None = None  # the process an embedded cluster lives and dies with
    host: str = HOST  # where pid and owner run (a state directory on NFS is seen from many)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (k8s name, ...)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterRecord:
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @property
    def age(self) -> float:
        return time.time() - self.started_at

    @property
    def elsewhere(self) -> bool:
        """Its supervisor or owner runs on another host: this one cannot check or stop it."""
        return self.host != HOST and (self.pid is not None or self.owner is not None)

    @property
    def starting(self) -> bool:
        """A claim written before the cluster had an address (``lifecycle.start.Claim``)."""
        return not self.address


def write_record(record: ClusterRecord) -> Path:
    """Write atomically (temp file + rename), mode 0600."""
    path = _made_clusters_dir() / f"{record.name}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        with writable(path):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(record.to_json())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a torn temp file behind
    return path


@dataclass
class Unreadable:
    """A record file that exists but cannot be parsed (a torn write, an edit by hand)."""

    name: str
    path: Path
    reason: str


def load_record(name: str) -> ClusterRecord | Unreadable | None:
    """The record of ``name``; ``Unreadable`` (never hidden) if its file cannot be parsed."""
    path = record_path(name)
    try:
        return ClusterRecord.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, OSError) as error:
        return Unreadable(name, path, f"{type(error).__name__}: {error}"[:200])


def read_record(name: str) -> ClusterRecord | None:
    """The record of ``name`` if it exists and parses."""
    loaded = load_record(name)
    return loaded if isinstance(loaded, ClusterRecord) else None


def unreadable_records() -> list[Unreadable]:
    found = (load_record(path.stem) for path in sorted(clusters_dir().glob("*.json")))
    return [entry for entry in found if isinstance(entry, Unreadable)]


def write_pid_file(name: str, pid: int) -> None:
    """The supervisor's pid beside its record, so a cluster is found even without the record."""
    path = cluster_dir(name) / PID_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{pid} {HOST}")


def starting_clusters() -> list[str]:
    """Names whose supervisor runs but has written no record yet."""
    found = []
    for directory in sorted(clusters_dir().glob("*/")):
        name = directory.name
        if not record_path(name).exists() and supervisor_pid(name):
            found.append(name)
    return found


def pid_file(name: str) -> tuple[int, str] | None:
    """The supervisor's pid and host from the cluster's pid file (host: this one if unsaid)."""
    try:
        pid_text, _, host = (clusters_dir() / name / PID_FILE).read_text().partition(" ")
        return int(pid_text), host.strip() or HOST
    except (OSError, ValueError):
        return None


def supervisor_pid(name: str) -> int | None:
    """The pid in the cluster's pid file, if that process runs on this host."""
    found = pid_file(name)
    if found is None or found[1] != HOST:
        return None  # another host's process: this one's pid of that number is unrelated
    return found[0] if pid_alive(found[0]) else None


def remove_cluster(name: str) -> None:
    """Delete the record and the cluster's private directory."""
    with contextlib.suppress(FileNotFoundError):
        record_path(name).unlink()
    with contextlib.suppress(OSError, StateError):
        control_socket(name).unlink(missing_ok=True)
    shutil.rmtree(clusters_dir() / name, ignore_errors=True)
    _drop_lock_file(name)


def pid_alive(pid: int | None) -> bool:
    """Whether a process runs (and is not a zombie)."""
    import psutil

    if not pid:
        return False
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def is_live(record: ClusterRecord) -> bool:
    """A supervised record is live while its supervisor runs, an embedded one while its owner
    runs, a detached one until `down`."""
    if record.elsewhere:
        return True  # its host knows; never taken for dead (and reaped) from here
    if record.owner is not None:
        return pid_alive(record.owner)
    return record.pid is None or pid_alive(record.pid)


def records() -> list[ClusterRecord]:
    """Every readable record, live or dead (a dead one is reaped by ``down``, never dropped)."""
    found = (read_record(path.stem) for path in sorted(clusters_dir().glob("*.json")))
    return [record for record in found if record is not None]


@contextlib.contextmanager
def lock(name: str, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on one cluster name (held while `up` or `down` runs). Unlinked, still
    held, once nothing of the cluster is left: a waiter then finds another file (or none)."""
    path = _made_clusters_dir() / f"{name}.lock"
    while True:
        with writable(path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        if _is_file_at(fd, path):
            break
        os.close(fd)
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            if not record_path(name).exists() and not (clusters_dir() / name).exists():
                path.unlink()
        os.close(fd)


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _drop_lock_file(name: str) -> None:
    """Unlink the name's lock file unless it is held (its holder then unlinks it)."""
    path = clusters_dir() / f"{name}.lock"
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _is_file_at(fd, path):
                path.unlink()
        finally:
            os.close(fd)


@contextlib.contextmanager
def starting(name: str) -> Iterator[None]:
    """Hold the name for an `up`; a concurrent `up` of the same name fails at once."""
    with lock(name, wait=False) as held:
        if not held:
            raise ClusterExists(f"cluster '{name}' is being started by another process")
        yield


# ------------------------------------------------------------------ run records (detached runs)


def runs_dir() -> Path:
    """Where detached runs keep their records (``ID.json``) and folders, beside ``clusters``."""
    return state_dir() / "runs"


def run_dir(run_id: str) -> Path:
    """The private folder of one run (driver log, progress, stop request), made 0700."""
    path = state_dir()
    with writable(path):
        for directory in (path, path / "runs", path / "runs" / run_id):
            _private_dir(directory)
    return path / "runs" / run_id


def run_record_path(run_id: str) -> Path:
    return runs_dir() / f"{run_id}.json"


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` atomically (temp file + rename), mode 0600, in an existing directory."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with writable(path):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_run_record(run_id: str, text: str) -> Path:
    """The run's record, atomically and 0600 (its folder is made with it)."""
    run_dir(run_id)
    return write_private(run_record_path(run_id), text)


def run_ids() -> list[str]:
    """IDs of every run record file, readable or not (oldest name first)."""
    return sorted(path.stem for path in runs_dir().glob("*.json"))
