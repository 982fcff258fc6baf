"""Gang (multi-rank) trials on a real SLURM: ``ranks_per_trial=2`` on two workers in two jobs."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import optuna
import pytest

from clusterkit import api
from clusterkit.client import get_client
from clusterkit.runners import hpo
from tests import slurm as S
from tests.contract import gang_search_contract
from tests.test_slurm import empty_queue_after, profile_file  # noqa: F401 - fixture

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(300)
def test_gang_search_two_ranks_per_trial_in_two_jobs(slurm: S.Slurm, tmp_path: Path) -> None:
    profile = profile_file(tmp_path, "gangs", workers=2, memory="2GiB")
    for seen in gang_search_contract(profile):
        jobs = [rank[5] for rank in seen]
        assert None not in jobs and len(set(jobs)) == 2, f"a gang ran in one job: {jobs}"


STEPS, STEP_SECONDS = 30, 0.5  # 15 s of work: the job is cancelled a few steps in


def signalled(trial: Any) -> float:
    """A gang objective in torchrun's manner: every rank notes its SLURM job and its steps, asks
    ``hpo.should_checkpoint()`` each step; when told, rank 0 saves, all leave together."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    x = trial.suggest_float("x", -1.0, 1.0)
    folder = hpo.checkpoint_dir(trial)
    saved = folder / "state.json"
    step, total = json.loads(saved.read_text()) if saved.exists() else (0, 0.0)
    with open(folder / f"started-rank{rank}.jsonl", "a") as log:
        log.write(json.dumps([step, os.environ.get("SLURM_JOB_ID")]) + "\n")
    while step < STEPS:
        if hpo.should_checkpoint():
            with open(folder / f"saw-rank{rank}.jsonl", "a") as log:
                log.write(json.dumps(step) + "\n")
            if rank == 0:
                saved.write_text(json.dumps([step, total]))
            dist.barrier()
            raise hpo.TrialInterrupted(f"saved at step {step}")
        dist.all_reduce(torch.ones(1))
        time.sleep(STEP_SECONDS)
        total += x * x / STEPS
        step += 1
        (folder / f"step-rank{rank}").write_text(str(step))
    return total


def _lines(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(400)
def test_a_gang_whose_job_slurm_cancels_saves_on_its_sigterm_and_resumes_in_other_jobs(
    slurm: S.Slurm, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``scancel`` of the job running rank 1 (SLURM's preemption or walltime path: SIGTERM to
    every process of the job, SIGKILL KillWait later): the gang saves at the same step on both
    ranks and resumes from it on workers in the other jobs; its hours are not lost."""
    from clusterkit.runners.ddp.driver import prepare

    caplog.set_level(logging.INFO, logger="clusterkit")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    profile = profile_file(tmp_path, "sigterm", workers=3, memory="2GiB")
    record = api.up(profile)
    folder = tmp_path / "checkpoints" / "trial-0"
    found: dict[str, Any] = {}
    try:
        with get_client(record.name) as client:
            client.wait_for_workers(3, timeout=120)
            prepare(client)
            search = threading.Thread(target=_search, args=(client, tmp_path, found), daemon=True)
            search.start()
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not (folder / "step-rank1").exists():
                time.sleep(0.2)
            while time.monotonic() < deadline and int((folder / "step-rank1").read_text()) < 4:
                time.sleep(0.2)
            (first, job), *_ = _lines(folder / "started-rank1.jsonl")
            assert first == 0 and job, "rank 1 runs in no SLURM job"
            slurm.run("scancel", job).check_returncode()  # SIGTERM, then SIGKILL
            search.join(timeout=240)
            assert not search.is_alive(), "the search did not end"
    finally:
        api.down(record.name)
    if "error" in found:
        raise found["error"]
    (trial,) = found["study"].get_trials(deepcopy=False)
    assert trial.state.name == "COMPLETE" and trial.value == pytest.approx(trial.params["x"] ** 2)
    saw = [_lines(folder / f"saw-rank{rank}.jsonl") for rank in (0, 1)]
    assert len(saw[0]) == 1 and saw[0] == saw[1], saw  # told once, at the same step
    starts = [_lines(folder / f"started-rank{rank}.jsonl") for rank in (0, 1)]
    assert [s[0] for s in starts[0]] == [0, saw[0][0]], starts  # resumed at the saved step
    resumed_jobs = {s[1][1] for s in starts}
    assert job not in resumed_jobs, "the resumed gang ran in the cancelled job"
    told = [r.getMessage() for r in caplog.records if "its ranks checkpoint" in r.getMessage()]
    assert len(told) == 1 and ("SIGTERM" in told[0] or "retiring" in told[0]), told
    assert "resuming it on workers with time left" in caplog.text
    account = json.loads((tmp_path / "out" / "account.json").read_text())
    assert account["lost"] <= 0.02 * account["held"], account  # the saved launch is kept


def _search(client: Any, tmp_path: Path, found: dict[str, Any]) -> None:
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    try:
        found["study"] = hpo.run(
            signalled,
            n_trials=1,
            client=client,
            study=study,
            progress=False,
            workdir=None,
            ranks_per_trial=2,
            checkpoint_dir=str(tmp_path / "checkpoints"),
            max_retries=0,
            out=str(tmp_path / "out"),
        )
    except BaseException as error:  # raised in the test's thread
        found["error"] = error
