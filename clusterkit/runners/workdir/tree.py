"""Worker side: find the project in place, or keep a synced copy of it up to date.

In place: the worker sees the project's root at the same path with every file's digest the
same (a shared disk). Otherwise a copy lives in ``CACHE/projects/NAME-KEY/`` (``CACHE`` is
``$CLUSTERKIT_WORKDIR_CACHE`` or ``TMPDIR/clusterkit-workdir-UID``); a manifest beside it records
which shipped file has which digest, so a rerun asks only for what changed. Files a run writes
into the copy stay there; shipped files that disappeared from the project are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from clusterkit.errors import StateError
from clusterkit.runners.workdir.project import FileEntry, Project, file_digest

CACHE_ENV = "CLUSTERKIT_WORKDIR_CACHE"

_lock = threading.Lock()
#: (project key, project digest) -> the directory ranks and trials run in on this worker
_located: dict[tuple[str, str, bool], tuple[str, str]] = {}


def cache_root() -> str:
    """This worker's cache of shipped projects: ``$CLUSTERKIT_WORKDIR_CACHE``, else a 0700
    directory of this user's in the temp directory.

    Trials and ranks run the code in it, so a cache that another user owns or may write to
    (say, made in the shared /tmp before this user's first run) is refused, never used.
    """
    root = os.environ.get(CACHE_ENV) or os.path.join(
        tempfile.gettempdir(), f"clusterkit-workdir-{os.getuid()}"
    )
    os.makedirs(root, mode=0o700, exist_ok=True)
    _check_private(root)
    os.makedirs(os.path.join(root, "incoming"), exist_ok=True)
    os.makedirs(os.path.join(root, "projects"), exist_ok=True)
    return root


def _check_private(root: str) -> None:
    info = os.stat(root)  # through a link: the directory it names must be ours
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise StateError(
            f"project cache {root} is not private to this user (owner uid {info.st_uid}, "
            f"mode {stat.S_IMODE(info.st_mode):o}): another user could change the code it runs",
            hint=f"remove it, or set {CACHE_ENV} to a directory only you can write",
        )


def store_id() -> str:
    """Identity of this cache directory: workers that share it need one upload between them."""
    path = os.path.join(cache_root(), "store-id")
    if not os.path.exists(path):
        temporary = f"{path}.{uuid.uuid4().hex}"
        with open(temporary, "w") as handle:
            handle.write(uuid.uuid4().hex)
        with contextlib.suppress(OSError):
            os.link(temporary, path)  # first writer wins; others read its id
        os.unlink(temporary)
    with open(path) as handle:
        return handle.read().strip()


def _in_place(project: Project) -> bool:
    if project.copy or not os.path.isdir(project.root):
        return False
    return all(_same(project, f) for f in project.files)


@contextlib.contextmanager
def _tree_lock(project: Project) -> Iterator[str]:
    """The synced copy's directory, locked against other workers sharing this cache."""
    base = os.path.join(cache_root(), "projects", project.name)
    os.makedirs(base, exist_ok=True)
    with open(base + ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield base
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _manifest(tree: str) -> dict[str, list[Any]]:
    """Shipped files of the copy still as shipped: path -> [digest, size, mtime_ns]."""
    try:
        with open(tree + ".manifest.json") as handle:
            recorded: dict[str, list[Any]] = json.load(handle)
    except (OSError, ValueError):
        return {}
    valid = {}
    for path, (digest, size, mtime) in recorded.items():
        try:
            info = os.stat(os.path.join(tree, path))
        except OSError:
            continue
        if info.st_size == size and info.st_mtime_ns == mtime:
            valid[path] = [digest, size, mtime]
    return valid


def _incoming(digest: str) -> str:
    return os.path.join(cache_root(), "incoming", digest)


def _missing(project: Project, tree: str) -> list[str]:
    have = {entry[0] for entry in _manifest(tree).values()}
    wanted = {f.digest for f in project.files}
    return sorted(d for d in wanted - have if not os.path.exists(_incoming(d)))


def _write(path: str, source: str, mode: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.ck-{uuid.uuid4().hex[:8]}"
    shutil.copyfile(source, temporary)
    os.chmod(temporary, mode)
    os.replace(temporary, path)


def _apply(project: Project, tree: str) -> None:
    """Bring the copy to the project's manifest from files it has and blobs received."""
    old = _manifest(tree)
    source = {entry[0]: os.path.join(tree, p) for p, entry in old.items()}
    for digest, path in source.items():  # moved content: stage it before anything is replaced
        if not os.path.exists(_incoming(digest)) and any(
            f.digest == digest and old.get(f.path, [None])[0] != digest for f in project.files
        ):
            shutil.copyfile(path, _incoming(digest))
    new: dict[str, list[Any]] = {}
    for entry in project.files:
        target = os.path.join(tree, entry.path)
        if old.get(entry.path, [None])[0] != entry.digest:
            _write(target, _incoming(entry.digest), entry.mode)
        info = os.stat(target)
        new[entry.path] = [entry.digest, info.st_size, info.st_mtime_ns]
    for path in set(old) - set(new):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(tree, path))
    with open(tree + ".manifest.json.tmp", "w") as handle:
        json.dump(new, handle)
    os.replace(tree + ".manifest.json.tmp", tree + ".manifest.json")
    for entry in project.files:
        with contextlib.suppress(OSError):
            os.unlink(_incoming(entry.digest))


def probe(project: Project) -> dict[str, Any]:
    """Locate the project on this worker; what is missing when it cannot be built yet.

    Also the directory trials run in, and for a copy why: the first of the project's files
    that differs here (None: no such directory here, or a copy was asked for)."""
    found = locate(project)
    if found is not None:
        return _probed(project, found[1], found[0], [])
    with _tree_lock(project) as tree:
        missing = _missing(project, tree)
        if not missing:
            _apply(project, tree)
            _remember(project, tree, "synced")
            return _probed(project, "synced", tree, [])
    return _probed(project, "missing", None, missing)


def _probed(
    project: Project, mode: str, directory: str | None, missing: list[str]
) -> dict[str, Any]:
    differs = None
    if mode != "in-place" and not project.copy and os.path.isdir(project.root):
        differs = next((f.path for f in project.files if not _same(project, f)), None)
    found = {"mode": mode, "store": store_id(), "missing": missing}
    return {**found, "directory": directory, "differs": differs}


def _same(project: Project, entry: FileEntry) -> bool:
    try:
        return file_digest(os.path.join(project.root, entry.path)) == entry.digest
    except OSError:
        return False


def receive(blobs: dict[str, bytes]) -> int:
    """Keep uploaded file contents until the copy is built (``probe`` builds it)."""
    for digest, data in blobs.items():
        temporary = f"{_incoming(digest)}.{uuid.uuid4().hex[:8]}"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, _incoming(digest))
    return sum(len(d) for d in blobs.values())


def read_blobs(project_key: str, digests: list[str]) -> dict[str, bytes]:
    """Contents this worker holds for ``digests`` (for a worker that joined later)."""
    wanted, found = set(digests), {}
    for name in os.listdir(os.path.join(cache_root(), "projects")):
        if name.endswith(project_key[:12] + ".manifest.json"):
            tree = os.path.join(cache_root(), "projects", name[: -len(".manifest.json")])
            for path, (digest, _, _) in _manifest(tree).items():
                if digest in wanted and digest not in found:
                    with open(os.path.join(tree, path), "rb") as handle:
                        found[digest] = handle.read()
    return found


def _remember(project: Project, directory: str, mode: str) -> None:
    with _lock:
        _located[(project.key, project.digest, project.copy)] = (directory, mode)


def locate(project: Project) -> tuple[str, str] | None:
    """(directory, "in-place" | "synced") when the project is ready on this worker."""
    with _lock:
        known = _located.get((project.key, project.digest, project.copy))
    if known is not None:
        return known
    if _in_place(project):
        _remember(project, project.root, "in-place")
        return project.root, "in-place"
    return None
