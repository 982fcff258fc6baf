"""Run records: one JSON file per detached run in ``<state dir>/runs``, with the cluster rules.

A record is written by the process that submits the run, then only by the run's monitor
(state, driver pid, restarts); the driver writes its progress to ``progress.json`` and
``runs stop`` its request to ``stop`` in the run's folder, so no two processes write one file.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clusterkit import state
from clusterkit.errors import BadInput
from clusterkit.state import HOST

KINDS = ("hpo", "train")
FINAL = ("succeeded", "failed", "stopped")
LOG_NAME = "driver.log"
MONITOR_LOG = "monitor.log"
PROGRESS_NAME = "progress.json"
STOP_NAME = "stop"
REQUEUE_NAME = "requeue"  # a batch run's job is being ended by its batch system


@dataclass
class RunRecord:
    """What a detached run is and where it stands."""

    id: str
    kind: str  # hpo | train
    argv: list[str]  # the spec as `clusterkit KIND ...`'s arguments, resolved (shown, logged)
    cwd: str
    profile: str  # the profile (or cluster) name the command was given
    cluster: str | None  # a cluster from `up` the driver attaches to; None: embedded
    results: str | None  # results folder (hpo) or checkpoint folder (train)
    max_restarts: int = 3
    #: starting | queued (batch) | running | restarting | succeeded | failed | stopped
    state: str = "starting"
    host: str = HOST
    monitor_pid: int | None = None
    driver_pid: int | None = None
    restarts: int = 0
    reasons: list[str] = field(default_factory=list)  # why each restart happened
    exit_code: int | None = None
    reason: str | None = None  # why a run ended as it did (failed, stopped)
    #: a run inside one batch job (``--batch``): its plan and job (clusterkit.runs.batch)
    batch: dict[str, Any] | None = None
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    #: what the driver runs: the checked RunSpec as JSON (clusterkit.runs.spec); None in a
    #: record from before specs, whose driver runs ``argv``
    spec: dict[str, Any] | None = None

    def save(self) -> Path:
        return state.write_run_record(self.id, json.dumps(asdict(self), indent=2))

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @property
    def folder(self) -> Path:
        return state.run_dir(self.id)

    @property
    def log(self) -> Path:
        return self.folder / LOG_NAME

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def elsewhere(self) -> bool:
        return self.host != state.HOST


@dataclass
class UnreadableRun:
    """A run record that exists but cannot be parsed: listed with its path, never hidden."""

    id: str
    path: Path
    reason: str


def new_id(kind: str) -> str:
    return f"{kind}-{time.strftime('%m%d')}-{secrets.token_hex(3)}"


def load(run_id: str) -> RunRecord | UnreadableRun | None:
    path = state.run_record_path(run_id)
    try:
        return RunRecord.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, OSError) as error:
        return UnreadableRun(run_id, path, f"{type(error).__name__}: {error}"[:200])


def get(run_id: str) -> RunRecord:
    """The record of ``run_id``; BadInput (exit 2) naming the known runs otherwise."""
    found = load(run_id) if run_id and "/" not in run_id else None
    if isinstance(found, RunRecord):
        return found
    if isinstance(found, UnreadableRun):
        raise BadInput(f"run '{run_id}' has an unreadable record {found.path}: {found.reason}")
    known = ", ".join(state.run_ids()) or "none"
    raise BadInput(f"no run '{run_id}' (known: {known})")


def all_runs() -> list[RunRecord | UnreadableRun]:
    """Every run in the order they started, the newest last (an unreadable record: by when
    its file was last written), as ``clusterkit ls`` lists clusters."""
    found = [entry for entry in map(load, state.run_ids()) if entry is not None]
    return sorted(found, key=lambda entry: (started(entry), entry.id))


def started(entry: RunRecord | UnreadableRun) -> float:
    if isinstance(entry, RunRecord):
        return entry.started_at
    try:
        return entry.path.stat().st_mtime
    except OSError:
        return 0.0


def progress(record: RunRecord) -> dict[str, Any]:
    """What the driver last reported (``done``, ``total``, ``best``, ``epoch``), or {}."""
    try:
        data = json.loads((state.runs_dir() / record.id / PROGRESS_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def request_stop(run_id: str) -> None:
    """Leave the stop request in the run's folder (private, as all of its state)."""
    state.write_private(state.run_dir(run_id) / STOP_NAME, "")


def stop_requested(record: RunRecord) -> bool:
    return (state.runs_dir() / record.id / STOP_NAME).exists()


def requeue_requested(record: RunRecord) -> bool:
    return (state.runs_dir() / record.id / REQUEUE_NAME).exists()
