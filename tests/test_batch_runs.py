"""Whole runs inside one batch job (``--batch``) on the real single-node SLURM.

The search's scheduler, driver and workers share one allocation: ``squeue`` lists exactly one
job while it runs, none after; ``runs stop`` ends the job; a job the batch system ends and
requeues resumes the search (each trial held once).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from clusterkit import runs
from clusterkit.runners.hpo.inputs import ATTR_ORPHANED, counted
from clusterkit.runs import batch
from clusterkit.runs.records import get
from tests import slurm as S

pytestmark = pytest.mark.slurm

OBJECTIVE = """
import time

def objective(trial):
    x = trial.suggest_float("x", -5, 5)
    time.sleep({sleep})
    return (x - 1) ** 2
"""


@pytest.fixture
def project(slurm: S.Slurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project folder (the working directory) with a 2-worker SLURM profile; every job of
    the test is gone after it."""
    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    profile = {
        "backend": "slurm",
        "queue": S.PARTITION,
        "workers": 2,
        "cores": 1,
        "memory": "1GiB",
        "walltime": "00:10:00",
        "requeue": True,
        "scheduler": {"dashboard": False},
    }
    (tmp_path / "sl.yaml").write_text(yaml.safe_dump(profile))
    yield tmp_path
    subprocess.run(["scancel", "--me"], check=False)
    _until("an empty queue", lambda: not _jobs(), timeout=60)


def _write_objective(root: Path, sleep: float) -> None:
    (root / "search.py").write_text(textwrap.dedent(OBJECTIVE.format(sleep=sleep)))


def _jobs() -> list[str]:
    done = subprocess.run(["squeue", "-h", "-o", "%i|%j"], capture_output=True, text=True)
    return done.stdout.split()


def _until(what: str, check: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def _submit(root: Path, trials: int) -> str:
    command = ["clusterkit", "hpo", "search.py:objective", "-n", str(trials), "-p", "sl.yaml"]
    done = subprocess.run(
        [*command, "--study-name", "b", "--batch"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _study(root: Path) -> optuna.Study:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(root / "b.optuna.log")))
    return optuna.load_study(study_name="b", storage=storage)


def _numbers(root: Path) -> list[int]:
    """Numbers of the finished trials ([] before the study exists)."""
    if not (root / "b.optuna.log").exists():
        return []
    try:
        trials = _study(root).trials
    except KeyError:
        return []
    return sorted(t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE)


def test_a_batch_search_runs_inside_exactly_one_job(project: Path) -> None:
    _write_objective(project, 0.3)
    run_id = _submit(project, 8)
    seen: set[tuple[str, ...]] = set()
    while not get(run_id).final:
        seen.add(tuple(_jobs()))
        time.sleep(0.3)
    assert runs.wait(run_id, timeout=5) == 0, get(run_id).log.read_text()
    listed = [jobs for jobs in seen if jobs]
    assert listed and all(len(jobs) == 1 for jobs in listed), seen
    assert all(jobs[0].endswith(f"|ck-{run_id}") for jobs in listed), seen
    record = get(run_id)
    assert record.batch is not None and record.restarts == 0
    assert len(_numbers(project)) == 8
    _until("the job's end", lambda: not _jobs(), timeout=60)
    shown = runs.show(run_id)
    assert shown["state"] == "succeeded" and "slurm job" in shown["target"]
    log = record.log.read_text()
    assert "scheduler tls://127.0.0.1:" in log and "2 workers" in log


def test_runs_stop_ends_the_job_and_keeps_finished_trials(project: Path) -> None:
    _write_objective(project, 1.0)
    run_id = _submit(project, 200)
    _until("a finished trial", lambda: _numbers(project))
    record = runs.stop(run_id, timeout=60)
    assert record.state == "stopped", record
    _until("the job's end", lambda: not _jobs(), timeout=60)
    assert 1 <= len(_numbers(project)) < 200


def test_a_requeued_job_resumes_the_search_each_trial_once(project: Path) -> None:
    """The walltime's warning (SIGUSR1 to the batch step, as ``--signal=B:USR1@M`` sends
    it): the job requeues itself; then a requeue by SLURM (as a preemption)."""
    _write_objective(project, 0.5)
    run_id = _submit(project, 30)
    _until("a finished trial", lambda: _numbers(project))
    job = batch.job_id(get(run_id))
    assert job is not None
    script = (get(run_id).folder / "job.sh").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@60" in script
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    _until("the restarted job", lambda: get(run_id).restarts == 1, timeout=120)
    _until("a trial after the restart", lambda: get(run_id).state == "running", timeout=120)
    subprocess.run(["scontrol", "requeue", job], check=True)
    assert runs.wait(run_id, timeout=300) == 0, get(run_id).log.read_text()
    record = get(run_id)
    assert record.restarts == 2, record.reasons
    assert all(f"job {job} started again by slurm" in why for why in record.reasons)
    assert "requeued: the run resumes" in record.log.read_text()
    trials = _study(project).get_trials()
    kept = [t for t in trials if counted(t)]
    assert len(kept) == 30 and len({t.number for t in kept}) == 30
    # what the ended job had in flight is failed as an orphan, never counted
    assert len(trials) == 30 + sum(bool(t.user_attrs.get(ATTR_ORPHANED)) for t in trials)
    assert json.loads(record.folder.joinpath("progress.json").read_text())["done"] == 30


TRAIN = """
import time

import torch
import torch.distributed as dist


def train(ctx, epochs):
    state = ctx.load_checkpoint() or {"epoch": 0}
    total = torch.ones(1)
    for epoch in range(state["epoch"], int(epochs)):
        dist.all_reduce(total)  # both ranks in one gloo group, in their own tasks
        time.sleep(0.2)
        if ctx.rank == 0:
            ctx.save_checkpoint({"epoch": epoch + 1})
    return dist.get_world_size()
"""


def test_a_batch_training_runs_its_ranks_in_the_jobs_tasks(project: Path) -> None:
    (project / "fit.py").write_text(textwrap.dedent(TRAIN))
    done = subprocess.run(
        ["clusterkit", "train", "fit.py:train", "-p", "sl.yaml", "--batch", "--", "4"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    assert runs.wait(run_id, timeout=180) == 0, get(run_id).log.read_text()
    record = get(run_id)
    assert json.loads(record.folder.joinpath("progress.json").read_text())["epoch"] == 4
    assert (record.folder / "checkpoints" / "checkpoint.pt").exists()
    assert "2 workers" in record.log.read_text()
