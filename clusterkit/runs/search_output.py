"""What a search shows (:mod:`clusterkit.runs.search`): each failure in one line (every
traceback in the results folder's ``search.log``, on the terminal too with
``CLUSTERKIT_DEBUG=1``), the result as data on stdout (``best:`` and ``results:`` lines, or
``--json``), and SIGTERM stopping the search as Ctrl-C does."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The search's log in its results folder: every record, tracebacks included.
LOG_NAME = "search.log"
#: The logger tree of the search runner.
SEARCH_LOGGER = "clusterkit.runners.hpo"


class _LazyFile(logging.FileHandler):
    """The log file, made (with its folder) on the first record only."""

    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr as it is when a record comes: the progress display redirects it meanwhile."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


@contextlib.contextmanager
def search_log(folder: str) -> Iterator[Path]:
    """The search's loggers for the command's span: one line per warning on stderr (every
    record with ``CLUSTERKIT_DEBUG=1``), every record with its traceback in ``folder``'s log."""
    path = Path(folder) / LOG_NAME
    logger = logging.getLogger(SEARCH_LOGGER)
    terminal = _Stderr()
    terminal.setLevel(logging.DEBUG if os.environ.get("CLUSTERKIT_DEBUG") else logging.WARNING)
    terminal.setFormatter(logging.Formatter("%(message)s"))
    log_file = _LazyFile(path, encoding="utf-8", delay=True)
    log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # not a second time through handlers the caller may have
    logger.addHandler(terminal)
    logger.addHandler(log_file)
    try:
        yield path
    finally:
        logger.removeHandler(terminal)
        logger.removeHandler(log_file)
        log_file.close()
        logger.level, logger.propagate = saved


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, once, as Ctrl-C does: the search stops and writes its
    results so far. Only where SIGTERM still has its default action (a detached run's driver
    has its own handler) and on the main thread."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the unwinding must not be cut
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def show_result(study: Any, folder: str, log: Path, as_json: bool) -> None:
    """The result on stdout: ``best: ...`` and ``results: ...``, or one JSON document; where
    trials failed, one line on stderr says where their tracebacks are."""
    from clusterkit import console
    from clusterkit.runners.hpo import report
    from clusterkit.runners.hpo.records import best_summary

    if as_json:
        console.print_json(result_document(study, folder, log))
        return
    failed = report.summary(study)["trials"]["fail"]
    if failed:
        console.message(f"{failed} trials failed; their tracebacks: {log}")
    sys.stdout.write(
        f"{best_summary(study)}\nresults: {folder}/ (report.html, trials.csv, *.png)\n"
    )


def result_document(study: Any, folder: str, log: Path) -> dict[str, Any]:
    """``--json``'s document: the search's summary, its results folder and log, and the
    account of its hours (None where none was written)."""
    from clusterkit.runners.hpo import account, report

    spent = account.read(folder)
    document = {**report.summary(study), "results": str(folder), "log": str(log)}
    return {**document, "account": None if spent is None else spent.to_json()}
