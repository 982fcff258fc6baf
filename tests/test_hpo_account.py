"""The account of the hours (:mod:`clusterkit.runners.hpo.account`): exact splits of hand-made
intervals, then real searches on a LocalCluster whose account adds up to the slot-seconds held."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import account, inputs
from clusterkit.runners.hpo.account import Held, Ledger, Segment, split
from clusterkit.runs.records import RunRecord

#: How far the account's held slot-seconds may be from the slots x the search's span.
TOLERANCE = 0.01


def hand_made() -> account.Account:
    """w1: 2 slots over [0, 100); w2: 1 slot over [50, 100); five attempts, one past w2's end."""
    held = [Held("w1", 0.0, 100.0, 2), Held("w2", 50.0, 100.0, 1)]
    segments = [
        Segment("w1", 0, 0.0, 40.0, 1, "finished"),
        Segment("w1", 1, 0.0, 30.0, 1, "pruned"),
        Segment("w1", 2, 30.0, 90.0, 1, "failed"),
        Segment("w2", 3, 50.0, 70.0, 1, "lost"),  # its worker died: run again
        Segment("w2", 3, 70.0, 110.0, 1, "finished"),  # counted to w2's end only
        Segment("gone", 4, 0.0, 10.0, 1, "finished"),  # on no worker held: not counted
    ]
    return split(held, segments, "core", since=0.0, until=100.0)


@pytest.mark.unit
def test_the_split_of_hand_made_intervals_is_exact() -> None:
    result = hand_made()
    assert result.total == {"finished": 70, "pruned": 30, "failed": 60, "lost": 20, "idle": 70}
    assert result.held == 250  # 2 x 100 + 1 x 50
    assert result.workers["w1"] == {
        "slots": 2,
        "start": 0,
        "end": 100,
        "finished": 40,
        "pruned": 30,
        "failed": 60,
        "lost": 0,
        "idle": 70,
        "held": 200,
    }
    assert result.workers["w2"]["idle"] == 0 and result.workers["w2"]["held"] == 50
    assert result.trials == {
        0: {"finished": 40},
        1: {"pruned": 30},
        2: {"failed": 60},
        3: {"lost": 20, "finished": 30},
    }
    assert account.line(result) == (
        "hours: 0.0694 core-h held, 28% finished, 12% pruned, 24% failed, 8% lost, 28% idle"
    )
    again = account.Account.from_json(json.loads(json.dumps(result.to_json())))
    assert again == result


@pytest.mark.unit
def test_the_split_counts_only_the_searchs_span() -> None:
    """A worker there before the search, a trial of an earlier run: from ``since`` on only."""
    held = [Held("w", -50.0, 100.0, 1)]
    segments = [Segment("w", 0, -40.0, 20.0, 1, "finished"), Segment("w", 1, 20.0, 60.0, 1, "lost")]
    result = split(held, segments, "GPU", since=10.0, until=80.0)
    assert result.total == {"finished": 10, "pruned": 0, "failed": 0, "lost": 40, "idle": 20}
    assert account.hours(result.held, result.unit) == "0.0194 GPU-h"


@pytest.mark.unit
def test_the_ledger_turns_events_into_intervals() -> None:
    """Joins and leaves from the scheduler's events, a lost attempt cut at its worker's leave,
    a trial's record as its last attempt, an attempt open at the end lost."""
    ledger = Ledger({"GPU": 1}, since=100.0)
    ledger.seen({"a": {"resources": {"GPU": 2}, "nthreads": 8}}, now=100.0)
    ledger.event((110.0, {"action": "add-worker", "worker": "b"}))
    ledger.seen({"a": {"resources": {"GPU": 2}}, "b": {"resources": {"GPU": 1}}})
    ledger.started(0, "b", 112.0)
    ledger.event((130.0, {"action": "remove-worker", "worker": "b"}))
    ledger.started(0, "a", 135.0)  # the retry: the attempt on b was lost when b left
    record = {"worker": "a", "start": 135.0, "end": 150.0, "state": "COMPLETE"}
    ledger.ended(0, record)
    ledger.started(1, "a", 140.0)
    ledger.close()
    ledger.until = 160.0  # the close's stamp, made exact
    ledger.segments[-1] = ledger.segments[-1]._replace(end=160.0)
    result = ledger.account()
    assert result.unit == "GPU"
    assert ledger.segments == [
        Segment("b", 0, 112.0, 130.0, 1.0, "lost"),
        Segment("a", 0, 135.0, 150.0, 1.0, "finished"),
        Segment("a", 1, 140.0, 160.0, 1.0, "lost"),
    ]
    # a: 2 GPUs x 60 s; b: 1 GPU x 20 s
    assert result.total == {"finished": 15, "pruned": 0, "failed": 0, "lost": 38, "idle": 87}


@pytest.mark.unit
def test_a_checkpointed_attempt_counts_toward_its_trials_outcome() -> None:
    """An attempt that saved a checkpoint (TrialInterrupted) is lost while its trial runs on,
    then counts as the trial's outcome; one whose worker died is lost for good (redone)."""
    ledger = Ledger(None, since=0.0)
    ledger.seen({"a": {"nthreads": 1}, "b": {"nthreads": 1}}, now=0.0)
    ledger.started(0, "a", 0.0)
    ledger.lost(0, 30.0, cause=hpo.TrialInterrupted())  # saved 30 s of work
    ledger.started(1, "b", 0.0)
    ledger.lost(1, 20.0, cause=OSError("worker gone"))
    ledger.started(0, "b", 31.0)
    assert ledger.account().total["lost"] == pytest.approx(30.0 + 20.0 + 0.0)
    before = ledger.ended(0, {"worker": "b", "start": 31.0, "end": 41.0, "state": "COMPLETE"})
    assert before == 30.0  # the trial ran 40 s in all: placement's estimate counts them
    ledger.until = 50.0
    result = ledger.account()
    assert result.trials[0] == {"finished": 40.0}
    assert result.total == {"finished": 40, "pruned": 0, "failed": 0, "lost": 20, "idle": 40}


@pytest.mark.unit
def test_the_progress_line_shows_the_hours_so_far() -> None:
    from clusterkit.runners.hpo.report import ProgressDisplay

    ledger = Ledger(None, since=0.0)
    ledger.seen({"a": {"nthreads": 2}}, now=0.0)
    ledger.ended(0, {"worker": "a", "start": 0.0, "end": 900.0, "state": "COMPLETE"})
    ledger.until = 3600.0  # two cores for an hour, one of them 15 minutes on a trial
    assert account.so_far(ledger) == " | 2 core-h held, 12% finished"
    display = ProgressDisplay(4)
    try:
        assert display.hours_text() == ""
        display.ledger = ledger
        assert display.hours_text() == " | 2 core-h held, 12% finished"
    finally:
        display.close()


# ------------------------------------------------------------------ a real LocalCluster

SLEEP = 0.4


def mixed_objective(trial: optuna.Trial) -> float:
    """Completes, prunes (every 4th trial from #1) or fails (every 4th from #2), each after SLEEP
    seconds: by the trial's number, so every outcome is there whatever the sampler draws."""
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(SLEEP)
    if trial.number % 4 == 1:
        raise optuna.TrialPruned()
    if trial.number % 4 == 2:
        raise ValueError("too large")
    return x * x


@pytest.fixture
def two_workers() -> Iterator[object]:
    """A client on two one-thread worker processes (nannies restart a worker that dies)."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        yield client


def seconds_by_state(study: optuna.Study, state: str) -> float:
    spans = [
        t.user_attrs[inputs.ATTR_TIME]
        for t in study.get_trials(deepcopy=False)
        if t.state.name == state
    ]
    return sum(end - start for start, end in spans)


def shown(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``clusterkit ARGS``' stdout, run in this process (exit status 0)."""
    from clusterkit.cli import main

    with contextlib.suppress(SystemExit):
        main(list(args))
    return capsys.readouterr().out


@pytest.mark.local
def test_a_local_search_accounts_for_every_slot_second(
    two_workers: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study = hpo.run(
        mixed_objective,
        n_trials=12,
        client=two_workers,  # type: ignore[arg-type]
        storage=optuna.storages.InMemoryStorage(),
        sampler=optuna.samplers.RandomSampler(seed=3),
        progress=False,
        out=str(tmp_path),
    )
    data = json.loads((tmp_path / "account.json").read_text())
    assert data["unit"] == "core"
    parts = sum(data[kind] for kind in account.KINDS)
    assert parts == pytest.approx(data["held"], rel=1e-9)
    slots_times_span = 2 * (data["until"] - data["since"])  # two one-core workers throughout
    assert data["held"] == pytest.approx(slots_times_span, rel=TOLERANCE)
    for kind, state in account.BY_STATE.items():
        assert data[state] == pytest.approx(seconds_by_state(study, kind), rel=1e-6), state
    assert min(data["finished"], data["pruned"], data["failed"]) > 0, data
    assert data["lost"] == 0 and data["idle"] > 0
    assert len(data["trials"]) == 12 and len(data["workers"]) == 2
    page = (tmp_path / "report.html").read_text()
    assert 'id="account"' in page and 'id="hours"' in page and "% finished" in page
    assert (tmp_path / "hours.png").stat().st_size > 0
    # `runs show` of a run whose results folder it is (relative to its working directory)
    where = dict(cwd=str(tmp_path.parent), results=tmp_path.name, profile="local", cluster=None)
    RunRecord(id="hpo-hours", kind="hpo", argv=[], state="succeeded", **where).save()
    text = shown(capsys, "runs", "show", "hpo-hours")
    expected = account.line(account.Account.from_json(data)).removeprefix("hours: ")
    assert ["hours:", expected] in [row.split(None, 1) for row in text.splitlines()], text
    assert json.loads(shown(capsys, "runs", "show", "hpo-hours", "--json"))["account"] == data


@pytest.mark.local
def test_status_shows_the_hours_held_since_up_and_the_share_busy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clusterkit import api
    from clusterkit.client import connect

    profile = tmp_path / "two.yaml"
    profile.write_text("backend: local\nworkers: 2\nworker:\n  threads: 1\n")
    record = api.up(profile, name="hours")
    try:
        with connect(record) as client:
            client.wait_for_workers(2)
            began = time.time()
            study = hpo.run(
                mixed_objective,
                n_trials=8,
                client=client,
                storage=optuna.storages.InMemoryStorage(),
                progress=False,
            )
            ended = time.time()
        hours = json.loads(shown(capsys, "status", "hours", "--json"))["hours"]
        asked = time.time()
        text = shown(capsys, "status", "hours")
    finally:
        api.down("hours")
    trials = sum(seconds_by_state(study, state) for state in account.BY_STATE)
    assert 2 * (ended - began) <= hours["held"] <= 2 * (asked - hours["since"]), hours
    assert trials <= hours["busy"] <= hours["held"], (trials, hours)
    assert hours["share_busy"] == pytest.approx(hours["busy"] / hours["held"])
    assert re.search(r"^hours: [0-9.e-]+ core-h held since up, \d+% busy$", text, re.M), text


def dies_once(marker: Path) -> object:
    """An objective: trial 0's first attempt kills its worker after a second (``marker`` tells
    it the attempt was made); every trial takes SLEEP."""

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", -1.0, 1.0)
        if trial.number == 0 and not marker.exists():
            marker.write_text("died")
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(SLEEP)
        return x * x

    return objective


@pytest.mark.local
def test_the_attempt_on_a_worker_that_died_is_lost(two_workers: object, tmp_path: Path) -> None:
    study = hpo.run(
        dies_once(tmp_path / "marker"),  # type: ignore[arg-type]
        n_trials=6,
        client=two_workers,  # type: ignore[arg-type]
        storage=optuna.storages.InMemoryStorage(),
        progress=False,
        out=str(tmp_path / "out"),
    )
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 6
    data = json.loads((tmp_path / "out" / "account.json").read_text())
    # the attempt held its slot from its start till its worker left: its second before the
    # kill, and however long the scheduler took to see the worker gone
    (dead,) = [w for w in data["workers"].values() if w["end"] < data["until"]]
    assert dead["lost"] == data["lost"] == data["trials"]["0"]["lost"], data
    assert 1.0 <= data["lost"] <= dead["end"] - dead["start"], data
    assert sum(data[kind] for kind in account.KINDS) == pytest.approx(data["held"], rel=1e-9)
    assert data["finished"] == pytest.approx(seconds_by_state(study, "COMPLETE"), rel=1e-6)


# ------------------------------------------------------------------ a real single-node SLURM

SLURM_OBJECTIVE = """
import time

def objective(trial):
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(1.0)
    return x * x
"""


def slurm_start(job: str) -> float:
    """The job's StartTime as ``scontrol show job`` reports it (seconds since the epoch)."""
    import re
    import subprocess
    from datetime import datetime

    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"\bStartTime=(\S+)", shown)
    assert match, shown
    return datetime.fromisoformat(match.group(1)).timestamp()


def search_with_a_late_job(profile: Path, tmp_path: Path, start_of: Callable[[str], float]) -> None:
    """Up ``profile`` (one job) and search, scaling to two jobs after trial 2: the late job's
    worker holds its core from the job's start as ``start_of(job)`` (asked while the jobs run)
    gives it, before the worker registered; the account adds up to the held time."""
    from clusterkit import api
    from clusterkit.client import get_client

    namespace: dict[str, object] = {}
    exec(SLURM_OBJECTIVE, namespace)  # a plain function, pickled by value to the workers
    record = api.up(profile)

    def scale_up(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if trial.number == 2:
            api.scale(record.name, 2, wait=False)

    try:
        with get_client(record.name) as client:
            study = hpo.run(
                namespace["objective"],  # type: ignore[arg-type]
                n_trials=24,
                client=client,
                progress=False,
                storage=optuna.storages.InMemoryStorage(),
                out=str(tmp_path / "out"),
                callbacks=[scale_up],
            )
        found = json.loads((tmp_path / "out" / "account.json").read_text())
        late = {w: v for w, v in found["workers"].items() if v["joined"] > found["since"]}
        assert late, f"the second job's worker did not join during the search: {found}"
        starts = {held["job"]: start_of(held["job"]) for held in late.values() if held["job"]}
    finally:
        api.down(record.name)
    for worker, held in late.items():
        assert held.get("job") in starts, (worker, held, starts)
        assert held["start"] < held["joined"], (worker, held)
        assert held["start"] == pytest.approx(starts[held["job"]], abs=1.0)
        assert held["finished"] > 0, (worker, held)
    assert sum(found[kind] for kind in account.KINDS) == pytest.approx(found["held"], rel=1e-9)
    assert found["finished"] == pytest.approx(seconds_by_state(study, "COMPLETE"), rel=1e-6)


@pytest.mark.slurm
def test_a_slurm_search_counts_a_job_from_its_start(slurm: object, tmp_path: Path) -> None:
    """A job started mid-search: its worker holds its core from the job's start as SLURM
    reports it (``scontrol show job``'s StartTime), before the worker registered."""
    from tests.test_slurm import profile_file

    profile = profile_file(tmp_path, "acct", workers=1, walltime="00:05:00")
    search_with_a_late_job(profile, tmp_path, slurm_start)


# ------------------------------------------------------------------ a real single-node Grid Engine


def sge_starts() -> dict[str, float]:
    """Each running job's start as ``qstat -xml`` lists it (``JAT_start_time``, local time to
    the second), by job id: another command than the account's ``qstat -j ID -xml``."""
    import subprocess
    import xml.etree.ElementTree as ET
    from datetime import datetime

    shown = subprocess.run(
        ["qstat", "-u", "*", "-xml"], capture_output=True, text=True, check=True
    ).stdout
    return {
        job.findtext("JB_job_number", ""): datetime.fromisoformat(
            job.findtext("JAT_start_time", "")
        ).timestamp()
        for job in ET.fromstring(shown).iter("job_list")
        if job.findtext("JAT_start_time")
    }


@pytest.mark.sge
def test_a_grid_engine_search_counts_a_job_from_its_start(sge: object, tmp_path: Path) -> None:
    """As on SLURM: a job started mid-search holds its core from the job's start as Grid Engine
    reports it (within 1 s: qstat gives whole seconds), before its worker registered."""
    from tests.test_sge import profile_file

    profile = profile_file(tmp_path, "acct", walltime="00:05:00")
    search_with_a_late_job(profile, tmp_path, lambda job: sge_starts()[job])
