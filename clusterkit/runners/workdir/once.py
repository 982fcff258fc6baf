"""Warnings raised in every rank or trial, shown once on the driver with a count.

Worker side, ``recorded()`` catches the warnings a rank or trial raises (per thread, so
concurrent trials keep theirs apart) instead of printing them; they travel to the driver on a
scheduler topic, where a :class:`Collector` counts each distinct one and ``summary`` warns once
per warning: ``... (raised in 8 of the trials)``.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

_local = threading.local()
_hook_lock = threading.Lock()
_original_show: Any = None

Record = tuple[str, str, str, int]  # category name, message, file, line


def _show(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    sink: set[Record] | None = getattr(_local, "sink", None)
    if sink is None:
        _original_show(message, category, filename, lineno, file, line)
        return
    sink.add((category.__name__, str(message), filename, int(lineno)))


@contextlib.contextmanager
def recorded() -> Iterator[set[Record]]:
    """Collect this thread's warnings into the yielded set instead of showing them."""
    global _original_show
    with _hook_lock:
        if _original_show is None:
            _original_show = warnings.showwarning
            warnings.showwarning = _show
    reset = getattr(warnings, "_filters_mutated", None)
    if reset is not None:  # forget "already shown" marks: every trial reports its own
        reset()
    sink: set[Record] = set()
    _local.sink = sink
    try:
        yield sink
    finally:
        _local.sink = None


def send(topic: str, records: set[Record] | list[Any]) -> None:
    """Worker side: put ``records`` on the driver's topic (no-op outside a worker or empty)."""
    if not records:
        return
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return
    worker.log_event(topic, [list(r) for r in records])


class Collector:
    """Driver side: counts the warnings reported on ``topic``; ``summary`` shows each once."""

    def __init__(self, client: Any, topic: str) -> None:
        self.client = client
        self.topic = topic
        self.counts: Counter[Record] = Counter()
        client.subscribe_topic(topic, self._add)

    def _add(self, event: Any) -> None:
        _, records = event
        for category, message, filename, lineno in records:
            self.counts[(category, message, filename, int(lineno))] += 1

    def summary(self, what: str) -> None:
        """Stop listening; warn once per distinct warning with how many ``what`` raised it."""
        with contextlib.suppress(Exception):
            self.client.unsubscribe_topic(self.topic)
        for (name, message, filename, lineno), count in sorted(self.counts.items()):
            category = getattr(builtins, name, None)
            if not (isinstance(category, type) and issubclass(category, Warning)):
                category, message = UserWarning, f"{name}: {message}"
            text = f"{message} (raised in {count} {what})"
            warnings.warn_explicit(text, category, filename, lineno)
        self.counts.clear()
