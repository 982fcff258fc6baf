"""A detached driver's progress for `clusterkit runs`: the runners' live displays also write
``progress.json`` in the run's folder and a plain ``[progress]`` line to the driver's log (a
log file gets no live bar), at most once a second."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from clusterkit import state


def report_hpo(path: Path, every: float = 1.0) -> None:
    """Have the search's progress display also write ``progress.json`` (for `runs`) and a
    plain progress line to the log (for `runs logs -f`; rich draws no live bar in a file)."""
    from clusterkit.runners.hpo import report

    shown, closed = report.ProgressDisplay.update, report.ProgressDisplay.close
    last: dict[str, Any] = {"at": 0.0, "line": None, "study": None}

    def update(self: Any, study: Any, running: int, busy: int, total: int, queued: int = 0) -> None:
        shown(self, study, running, busy, total, queued)
        last["study"], last["total"], last["hours"] = study, total, self.hours_text()
        write(study, running, busy, total, final=False)

    def close(self: Any) -> None:  # a stopped search: what it holds now, not a second ago
        closed(self)
        if last["study"] is not None:
            write(last["study"], 0, 0, last["total"], final=True)

    def write(study: Any, running: int, busy: int, total: int, final: bool) -> None:
        counts = report._counts(study)
        done, best = sum(counts.values()), report._best_text(study)
        line = f"trials {done}/{total} | running {running} | best {best} | busy {busy}"
        line += last.get("hours", "")  # the hours' account so far: " | 0.4 core-h held, ..."
        now = time.monotonic()
        if line == last["line"] or (now - last["at"] < every and done < total and not final):
            return
        last.update(at=now, line=line)
        data = {"done": done, "total": total, "running": running, "best": best}
        state.write_private(path, json.dumps(data))
        print(f"[progress] {line}", file=sys.stderr, flush=True)

    report.ProgressDisplay.update = update  # type: ignore[method-assign]
    report.ProgressDisplay.close = close  # type: ignore[method-assign]


def report_train(path: Path, every: float = 1.0) -> None:
    """Have the training's status line also write ``progress.json`` (``{"epoch": 3, ...}``,
    for `runs`) and a ``[progress]`` line to the log, at most once every ``every`` seconds; a
    report held back is written when that second is over (or at the end), never lost."""
    import threading

    from clusterkit.runners.ddp.progress import ProgressDisplay, describe

    shown, closed = ProgressDisplay.update, ProgressDisplay.close
    lock = threading.Lock()
    last: dict[str, Any] = {"at": -every, "line": None, "held": None, "timer": None}

    def update(self: Any, progress: dict[str, Any]) -> None:
        shown(self, progress)
        write(progress)

    def close(self: Any) -> None:
        closed(self)
        with lock:
            held = last["held"]
            if last["timer"] is not None:
                last["timer"].cancel()
        if held is not None:
            write(held, final=True)

    def write(progress: dict[str, Any], final: bool = False) -> None:
        line = describe(progress)
        with lock:
            wait = last["at"] + every - time.monotonic()
            if line == last["line"]:
                last["held"] = None
                return
            if wait > 0 and not final:  # too soon: the latest is written once the second ends
                last["held"] = progress
                if last["timer"] is None:
                    timer = threading.Timer(wait, flush)
                    timer.daemon = True
                    timer.start()
                    last["timer"] = timer
                return
            last.update(at=time.monotonic(), line=line, held=None)
            state.write_private(path, json.dumps(progress))
            print(f"[progress] {line}", file=sys.stderr, flush=True)

    def flush() -> None:
        with lock:
            held, last["timer"] = last["held"], None
        if held is not None:
            write(held)

    ProgressDisplay.update = update  # type: ignore[method-assign]
    ProgressDisplay.close = close  # type: ignore[method-assign]
