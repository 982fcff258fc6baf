"""Training progress: what rank 0 reports, and how the driver shows it.

Rank 0 reports with ``ctx.report(epoch=..., **metrics)`` (or :func:`report` from a
torchrun-style script), and each ``ctx.save_checkpoint`` reports the saved state's ``epoch`` /
``step`` (else the count of checkpoints). The reports travel as Dask events: the rank's worker
logs them on the run's topic (``Worker.log_event``; at most every 0.25 s, the latest always),
the driver subscribes to it (``Client.subscribe_topic``) and passes each to ``on_progress``:
the status line of ``clusterkit train``, a detached run's ``progress.json``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

#: One report: ``epoch``, ``step`` (numbers), ``checkpoints`` (a count) and scalar metrics.
Progress = dict[str, Any]

POSITION = ("epoch", "step")  # where training is; a checkpoint's state may carry them
COUNT = "checkpoints"  # checkpoints saved by this rank process, when its state has no position

_context: Any = None  # the rank's Context, in a rank process (``report`` goes through it)


def set_context(ctx: Any) -> None:
    """Rank side: make ``ctx`` the target of :func:`report` in this process."""
    global _context
    _context = ctx


def report(epoch: float | None = None, step: float | None = None, **metrics: Any) -> None:
    """Show training progress on the driver (``epoch``, ``step``, scalar metrics).

    For torchrun-style scripts, same as ``ctx.report``: only rank 0's call counts, and outside
    a ``clusterkit train`` rank (plain ``torchrun``, ``python script.py``) it does nothing.
    """
    if _context is not None:
        _context.report(epoch, step, **metrics)


def _scalar(name: str, value: Any) -> Any:
    """``value`` as a plain JSON scalar; one-element tensors and numpy scalars are unwrapped."""
    if not isinstance(value, bool | int | float | str) and hasattr(value, "item"):
        with contextlib.suppress(ValueError, RuntimeError):  # more than one element
            value = value.item()
    if isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"progress {name!r} must be a number or a string, got {type(value).__name__}")


def message(
    epoch: Any = None, step: Any = None, metrics: Mapping[str, Any] | None = None
) -> Progress:
    """A report: position first, then the metrics as plain scalars (TypeError otherwise)."""
    data: Progress = {}
    for name, value in (("epoch", epoch), ("step", step)):
        if value is None:
            continue
        number = _scalar(name, value)
        if isinstance(number, bool | str):
            raise TypeError(f"progress {name!r} must be a number, got {number!r}")
        data[name] = number
    for name, value in (metrics or {}).items():
        data[name] = _scalar(name, value)
    return data


def from_checkpoint(state: Any, saved: int) -> Progress:
    """What a saved checkpoint says: its integer ``epoch`` / ``step``, else the count ``saved``."""
    found: Progress = {}
    if isinstance(state, Mapping):
        for name in POSITION:
            try:
                value = operator.index(state[name])
            except (KeyError, TypeError):
                continue
            if not isinstance(state[name], bool):
                found[name] = value
    return found or {COUNT: saved}


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe(progress: Progress) -> str:
    """One line: ``epoch 3, step 120, loss 0.41`` (``2 checkpoints saved`` without a position)."""
    parts = [f"{name} {_number(progress[name])}" for name in POSITION if name in progress]
    if not parts and COUNT in progress:
        count = progress[COUNT]
        parts.append(f"{count} checkpoint{'' if count == 1 else 's'} saved")
    skip = {*POSITION, COUNT}
    parts += [f"{name} {_number(value)}" for name, value in progress.items() if name not in skip]
    return ", ".join(parts)


class ProgressDisplay:
    """The status line of an attached ``clusterkit train``: ``LABEL: epoch 3, loss 0.41``.

    ``update`` is the run's ``on_progress`` (called on the client's event-loop thread).
    """

    def __init__(self, label: str) -> None:
        from clusterkit.console import err

        self.label = label
        self.latest: Progress | None = None
        self.status = err().status(f"{label}...")
        self.status.start()

    def update(self, progress: Progress) -> None:
        self.latest = progress
        self.status.update(f"{self.label}: {describe(progress)}")

    def write(self, stream: str, text: str) -> None:
        """The ranks' lines (``text``: whole lines) for this process's ``stream``, above the
        status line on a terminal, as they are: rich neither wraps nor reads markup in them.
        Redirected elsewhere, they go to that file untouched."""
        target = sys.stdout if stream == "stdout" else sys.stderr
        console = self.status.console
        if console.is_terminal and (stream == "stderr" or target.isatty()):
            from rich.text import Text

            console.print(Text.from_ansi(text.removesuffix("\n")), soft_wrap=True)
            return
        raw = getattr(target, "rich_proxied_file", target)  # not through rich's redirection
        raw.write(text)
        raw.flush()

    def close(self) -> None:
        self.status.stop()

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def subscribed(
    client: Any, topic: str, on_progress: Callable[[Progress], None] | None
) -> Iterator[None]:
    """While inside, each progress event on ``topic`` goes to ``on_progress`` (its errors are
    logged only: a broken display must not stop the training); nothing when it is None."""
    if on_progress is None:
        yield
        return

    def handle(event: tuple[float, dict[str, Progress]]) -> None:
        try:
            on_progress(dict(event[1]["progress"]))
        except Exception:
            logging.getLogger(__name__).warning("progress callback failed", exc_info=True)

    client.subscribe_topic(topic, handle)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a closed client must not hide the outcome
            client.unsubscribe_topic(topic)
