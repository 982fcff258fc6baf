"""The project directory on the driver: which files belong to it, their digests, the size cap.

Excluded: ``.git``, ``__pycache__``, virtual environments (a directory holding ``pyvenv.cfg``
or ``conda-meta``), whatever ``.gitignore`` files (at any depth) and an optional
``.clusterkitignore`` at the root list, in gitignore syntax (``pathspec``), and the files this
process writes: open for writing (its own ``> run.log 2>&1``, a SQLite study, a log file) or
declared (:func:`writes`: a study's journal). They change while workers compare digests (a
worker that joins later too) and are no part of the project.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

from clusterkit.errors import BadInput

MAX_SIZE_ENV = "CLUSTERKIT_WORKDIR_MAX_SIZE"  # the cap, e.g. "200MiB" (default 100 MiB)
COPY_ENV = "CLUSTERKIT_WORKDIR_COPY"  # "1": always the synced copy, never in place
DEFAULT_MAX_SIZE = 100 * 2**20
_ALWAYS_IGNORED = {".git", "__pycache__", ".hg", ".svn", ".mypy_cache", ".pytest_cache"}
_VENV_MARKERS = ("pyvenv.cfg", "conda-meta")
_CHUNK = 1 << 20

#: (path) -> (size, mtime_ns, inode, digest): digests of files that did not change are reused
_digests: dict[str, tuple[int, int, int, str]] = {}
#: Files this process writes while it runs, declared with :func:`writes` (real paths).
_outputs: set[str] = set()


@dataclass(frozen=True)
class FileEntry:
    """One file of the project: its path relative to the root, size, mode bits and digest."""

    path: str
    size: int
    mode: int
    digest: str


@dataclass(frozen=True)
class Project:
    """A scanned project directory: what a worker needs to find or rebuild it."""

    root: str
    files: tuple[FileEntry, ...]
    digest: str
    copy: bool = False
    key: str = field(default="")  # this directory on this machine (names the synced copy)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def name(self) -> str:
        return f"{os.path.basename(self.root) or 'project'}-{self.key[:12]}"


def file_digest(path: str) -> str:
    """sha256 of a file's bytes, reused while its size, mtime and inode stay the same."""
    info = os.stat(path)
    known = _digests.get(path)
    stamp = (info.st_size, info.st_mtime_ns, info.st_ino)
    if known is not None and known[:3] == stamp:
        return known[3]
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    digest = hasher.hexdigest()
    _digests[path] = (*stamp, digest)
    return digest


def _spec(directory: str, names: tuple[str, ...]) -> object | None:
    import pathspec

    lines: list[str] = []
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as handle:
                lines += handle.read().splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines) if lines else None


class _Ignore:
    """gitignore rules per directory (a rule applies below the directory that lists it)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.specs: list[tuple[str, object]] = []
        top = _spec(root, (".gitignore", ".clusterkitignore"))
        if top is not None:
            self.specs.append(("", top))

    def enter(self, relative_dir: str) -> None:
        if relative_dir:
            spec = _spec(os.path.join(self.root, relative_dir), (".gitignore",))
            if spec is not None:
                self.specs.append((relative_dir + "/", spec))

    def ignored(self, relative: str, is_dir: bool) -> bool:
        candidate = relative + "/" if is_dir else relative
        for base, spec in self.specs:
            if candidate.startswith(base) and spec.match_file(candidate[len(base) :]):  # type: ignore[attr-defined]
                return True
        return False


def _walk(root: str) -> list[tuple[str, int]]:
    """(relative path, size) of every file that belongs to the project, sorted."""
    ignore = _Ignore(root)
    found: list[tuple[str, int]] = []
    for directory, dirs, files in os.walk(root):
        relative_dir = os.path.relpath(directory, root)
        relative_dir = "" if relative_dir == "." else relative_dir
        ignore.enter(relative_dir)
        keep = []
        for name in sorted(dirs):
            relative = os.path.join(relative_dir, name)
            full = os.path.join(directory, name)
            if name in _ALWAYS_IGNORED or any(
                os.path.exists(os.path.join(full, m)) for m in _VENV_MARKERS
            ):
                continue
            if not ignore.ignored(relative, True):
                keep.append(name)
        dirs[:] = keep
        for name in files:
            relative = os.path.join(relative_dir, name)
            full = os.path.join(directory, name)
            if name.endswith((".pyc", ".pyo")) or ignore.ignored(relative, False):
                continue
            if os.path.isfile(full):
                found.append((relative, os.path.getsize(full)))
    return sorted(found)


def _human(size: float) -> str:
    from dask.utils import format_bytes

    return format_bytes(int(size))


def _check_cap(root: str, found: list[tuple[str, int]], max_size: int) -> None:
    total = sum(size for _, size in found)
    if total <= max_size:
        return
    largest = sorted(found, key=lambda f: -f[1])[:3]
    names = ", ".join(f"{path} ({_human(size)})" for path, size in largest)
    raise BadInput(
        f"project directory {root} holds {_human(total)}, over the {_human(max_size)} cap "
        f"(largest: {names})",
        hint="list big files in .clusterkitignore, raise --workdir-max-size, or --no-workdir",
    )


def parse_max_size(name: str, text: str) -> int:
    """A size cap from text like '200MiB'; BadInput naming ``name`` otherwise."""
    from dask.utils import parse_bytes

    try:
        size = int(parse_bytes(text))
    except (ValueError, TypeError):
        raise BadInput(f"{name}: expected a size like '200MiB', got {text!r}") from None
    if size <= 0:
        raise BadInput(f"{name}: the size must be positive, got {text!r}")
    return size


def max_size_from_env() -> int:
    text = os.environ.get(MAX_SIZE_ENV)
    return parse_max_size(MAX_SIZE_ENV, text) if text else DEFAULT_MAX_SIZE


def _state_inside(root: Path) -> str | None:
    """clusterkit's state directory (records, logs, cluster keys) as a prefix relative to
    ``root`` when it lies inside the project: never shipped. None when it lies elsewhere."""
    from clusterkit.state import state_dir

    private = state_dir().resolve()
    if root not in private.parents:
        return None
    return str(private.relative_to(root)) + os.sep


def writes(path: str | os.PathLike[str]) -> None:
    """Declare a file this process writes while it runs (a study's journal or database): no
    part of any project scanned or resolved from now on (see :func:`being_written`)."""
    _outputs.add(os.path.realpath(path))


def being_written(root: str) -> set[str]:
    """Files under ``root`` (relative paths) that this process writes: open for writing now,
    or declared with :func:`writes`."""
    import psutil

    prefix = root.rstrip(os.sep) + os.sep
    try:
        opened = {f.path for f in psutil.Process().open_files() if f.mode != "r"}
    except psutil.Error:  # not readable here: only what was declared
        opened = set()
    return {os.path.relpath(p, root) for p in opened | _outputs if p.startswith(prefix)}


def without_outputs(project: Project) -> Project:
    """``project`` less the files this process writes by now (scanned before it began to)."""
    written = being_written(project.root)
    if not any(f.path in written for f in project.files):
        return project
    kept = tuple(f for f in project.files if f.path not in written)
    return replace(project, files=kept, digest=_overall_digest(kept))


def _overall_digest(entries: tuple[FileEntry, ...] | list[FileEntry]) -> str:
    overall = hashlib.sha256()
    for entry in entries:
        overall.update(f"{entry.path}\0{entry.mode}\0{entry.digest}\n".encode())
    return overall.hexdigest()


def scan(
    root: str | os.PathLike[str], *, max_size: int | None = None, copy: bool | None = None
) -> Project:
    """Scan ``root`` into a :class:`Project` (BadInput when it is missing or over the cap)."""
    path = Path(root).expanduser().resolve()
    if not path.is_dir():
        raise BadInput(f"workdir {root} is not a directory", hint="pass an existing directory")
    limit = max_size_from_env() if max_size is None else max_size
    private = _state_inside(path)
    written = being_written(str(path))
    found = [
        e
        for e in _walk(str(path))
        if (private is None or not e[0].startswith(private)) and e[0] not in written
    ]
    _check_cap(str(path), found, limit)
    entries = []
    for relative, size in found:
        full = os.path.join(path, relative)
        try:
            digest = file_digest(full)
            mode = os.stat(full).st_mode & 0o777
        except FileNotFoundError:  # removed while the scan ran (a temporary file)
            continue
        entries.append(FileEntry(relative, size, mode, digest))
    forced = os.environ.get(COPY_ENV, "") in ("1", "true", "yes") if copy is None else copy
    key = hashlib.sha256(f"{socket.gethostname()}\0{path}".encode()).hexdigest()
    return Project(str(path), tuple(entries), _overall_digest(entries), forced, key)
