"""The default study storage: an Optuna journal file whose writes are batched between fsyncs.

Optuna's ``JournalFileBackend`` takes a file lock, writes and fsyncs once per storage call, and
re-opens the file on every read; a trial costs a handful of each. :class:`BatchedJournalBackend`
keeps the writes in memory (reads see them at once, in order) until :func:`flush`, which
appends them in one write under one lock and one fsync. The file stays a plain Optuna journal:
any Optuna process can open it.

The guarantee is the one fsync-per-write gives: a killed driver loses nothing it reported. The
driver flushes before it shows or logs progress, before it answers a worker's pruning question,
at most ``REPORT_EVERY`` (0.25 s) after a result came in, and before
:func:`clusterkit.runners.hpo.run` returns;
what it had not flushed, nothing outside the driver had seen. A trial whose result was received
but not yet flushed is, after a kill, either absent (it is asked again) or RUNNING (resume fails
it as an orphan and enqueues its parameters again), exactly as if the kill had come a moment
before the result arrived.

A pickled storage (Optuna's ``JournalStorage`` pickles its backend: a study sent to another
process, a deep copy) is a second handle on the same file. Pickling flushes first, so the copy
reads every write made before it; the copy starts with its own lock and nothing pending. Like
the original, it reads the file up to the logs it knows are there: one handle writes a study
at a time (one driver).
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any

from optuna.storages.journal import JournalFileBackend


class BatchedJournalBackend(JournalFileBackend):
    """A journal file whose appends wait in memory until :meth:`flush` (one write, one fsync)."""

    def __init__(self, file_path: str) -> None:
        super().__init__(file_path)
        self.path = file_path
        self._pending: list[dict[str, Any]] = []
        self._buffer_lock = threading.Lock()
        self._on_disk = self._count_on_disk(0)

    def _count_on_disk(self, known: int) -> int:
        """The logs in the file, counting on from ``known`` (read once, offsets cached)."""
        return known + sum(1 for _ in super().read_logs(known))

    def __getstate__(self) -> dict[str, Any]:
        self.flush()
        state = self.__dict__.copy()
        del state["_buffer_lock"], state["_pending"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._buffer_lock = threading.Lock()
        self._pending = []
        self._on_disk = self._count_on_disk(self._on_disk)  # what was flushed since the pickle

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        with self._buffer_lock:
            self._pending.extend(logs)

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        with self._buffer_lock:
            pending, on_disk = list(self._pending), self._on_disk
        if log_number_from < on_disk:
            for number, log in enumerate(super().read_logs(log_number_from), log_number_from):
                if number >= on_disk:
                    break
                yield log
        yield from pending[max(0, log_number_from - on_disk) :]

    def flush(self) -> None:
        """Append what waits, under the file lock, and fsync it."""
        with self._buffer_lock:
            pending, self._pending = self._pending, []
            if pending:
                super().append_logs(pending)
                self._on_disk += len(pending)


def open_journal(path: str) -> Any:
    """An Optuna ``JournalStorage`` on a batched journal file."""
    from optuna.storages import JournalStorage

    return JournalStorage(BatchedJournalBackend(path))


def journal_path(storage: Any) -> str | None:
    """The journal file ``storage`` writes (one :func:`open_journal` made), else None."""
    backend = getattr(storage, "_backend", None)
    return backend.path if isinstance(backend, BatchedJournalBackend) else None


def flush(storage: Any) -> None:
    """Make every write to ``storage`` durable (a no-op for storages that write through)."""
    backend = getattr(storage, "_backend", None)
    if isinstance(backend, BatchedJournalBackend):
        backend.flush()
