"""SIGTERM to a worker mid-trial (:mod:`clusterkit.runners.graceful`): the trial saves and
resumes elsewhere instead of being lost with its progress.

Kubernetes' way (a pod deletion): SIGTERM to the container's first process only, the ``dask
worker`` command, whose nanny passes it to its worker process. SLURM's way (walltime,
``scancel``, preemption: ``tests/test_slurm_gangs.py`` has the gang case): SIGTERM to every
process of the job, SIGKILL KillWait later."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import optuna
import pytest

from clusterkit import api
from clusterkit.client import get_client
from clusterkit.runners import hpo
from clusterkit.runners.hpo import inputs
from tests import slurm as S
from tests.test_slurm import empty_queue_after, profile_file  # noqa: F401 - fixture

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, STEP_SECONDS = 24, 0.5  # 12 s of work a trial


def stepwise(trial: optuna.Trial) -> float:
    """STEPS steps of x**2 / STEPS; its progress in ``progress-N``; saved when told."""
    x = trial.suggest_float("x", -1.0, 1.0)
    folder = hpo.checkpoint_dir(trial)
    saved = folder / "state.json"
    step, total = json.loads(saved.read_text()) if saved.exists() else (0, 0.0)
    with open(folder / "started.jsonl", "a") as log:
        log.write(json.dumps([step, os.getpid(), os.environ.get("SLURM_JOB_ID")]) + "\n")
    while step < STEPS:
        if hpo.should_checkpoint():
            saved.write_text(json.dumps([step, total]))
            raise hpo.TrialInterrupted(f"saved at step {step}")
        time.sleep(STEP_SECONDS)
        total += x * x / STEPS
        step += 1
        (folder / "progress").write_text(json.dumps([step, os.getpid()]))
    return total


def _started(folder: Path) -> list[list[Any]]:
    path = folder / "started.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Search(threading.Thread):
    """``hpo.run`` of :func:`stepwise` on ``client`` in a thread of its own."""

    def __init__(self, client: Any, tmp_path: Path, n_trials: int) -> None:
        super().__init__(daemon=True)
        self.client, self.tmp_path, self.n_trials = client, tmp_path, n_trials
        self.study: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.study = hpo.run(
                stepwise,
                n_trials=self.n_trials,
                client=self.client,
                storage=optuna.storages.InMemoryStorage(),
                progress=False,
                workdir=None,
                checkpoint_dir=str(self.tmp_path / "checkpoints"),
                max_retries=0,  # a lost attempt fails the trial: only a resume may run it again
                out=str(self.tmp_path / "out"),
            )
        except BaseException as error:
            self.error = error

    def trials(self) -> list[Any]:
        self.join(timeout=180)
        assert not self.is_alive(), "the search did not end"
        if self.error is not None:
            raise self.error
        return self.study.get_trials(deepcopy=False)


def _wait_for_steps(folder: Path, steps: int, pid: int | None = None) -> None:
    """Till the trial in ``folder`` made ``steps`` steps (in process ``pid``, if given)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (folder / "progress").exists():
            step, at = json.loads((folder / "progress").read_text() or "[0, 0]")
            if step >= steps and pid in (None, at):
                return
        time.sleep(0.1)
    pytest.fail(f"the trial in {folder} never made {steps} steps")


def _assert_resumed(trial: Any, folder: Path, signalled: Any) -> None:
    """COMPLETE with all its steps, run twice: from 0 where it was signalled, then from where
    it saved somewhere else; not a lost attempt (max_retries=0 would have failed it)."""
    assert trial.state.name == "COMPLETE", trial.user_attrs
    assert trial.value == pytest.approx(trial.params["x"] ** 2)
    (first, where), (again, elsewhere) = [(s[0], s[1:]) for s in _started(folder)]
    assert first == 0 and 0 < again < STEPS and signalled in where, _started(folder)
    assert signalled not in elsewhere
    assert trial.user_attrs[inputs.ATTR_ATTEMPTS] == 2


@pytest.fixture
def cluster_and_command(tmp_path: Path) -> Iterator[tuple[Any, subprocess.Popen[bytes]]]:
    """A client on a local cluster of one worker, and a second worker joined by a ``dask worker``
    command of its own (as a pod's container runs it), its process."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        command = subprocess.Popen(
            [
                *(sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address),
                *("--nthreads", "1", "--name", "pod", "--no-dashboard", "--host", "127.0.0.1"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "pod.log", "wb"),  # noqa: SIM115 - the child holds it
        )
        try:
            client.wait_for_workers(2, timeout=60)
            yield client, command
        finally:
            if command.poll() is None:
                command.kill()
            command.wait()


@pytest.mark.local
@pytest.mark.timeout(240)
def test_sigterm_to_a_dask_worker_command_retires_it_and_its_trial_resumes(
    cluster_and_command: tuple[Any, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    client, command = cluster_and_command
    workers = client.scheduler_info(n_workers=-1)["workers"]
    address = next(a for a, w in workers.items() if w["name"] == "pod")
    pod = client.run(os.getpid, workers=[address])[address]
    search = Search(client, tmp_path, n_trials=2)
    search.start()
    folders = [tmp_path / "checkpoints" / f"trial-{n}" for n in (0, 1)]
    deadline = time.monotonic() + 60
    while not any(pod in [s[1] for s in _started(f)] for f in folders):
        assert time.monotonic() < deadline, "no trial started on the pod's worker"
        time.sleep(0.1)
    folder = next(f for f in folders if pod in [s[1] for s in _started(f)])
    _wait_for_steps(folder, 4, pod)
    os.kill(command.pid, signal.SIGTERM)  # the first process only, as the kubelet does
    trials = search.trials()
    command.wait(timeout=60)  # it ended by itself once its trial saved
    assert command.returncode == 0, (tmp_path / "pod.log").read_text()[-2000:]
    _assert_resumed(trials[int(folder.name.split("-")[1])], folder, pod)
    deadline = time.monotonic() + 30  # Dask's own SIGTERM handling back after the search
    while any(client.run(_retires_on_sigterm).values()):
        assert time.monotonic() < deadline, "the workers still retire on SIGTERM"
        time.sleep(0.1)


def _retires_on_sigterm(dask_worker: Any) -> bool:
    from clusterkit.runners.graceful import NAME

    return NAME in dask_worker.plugins


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_trial_whose_slurm_job_is_cancelled_saves_on_its_sigterm_and_resumes(
    slurm: S.Slurm, tmp_path: Path
) -> None:
    """``scancel``: SIGTERM to every process of the job (the worker's too), SIGKILL KillWait
    later; the trial resumes in the other job."""
    record = api.up(profile_file(tmp_path, "sigterm1", workers=2))
    try:
        with get_client(record.name) as client:
            client.wait_for_workers(2, timeout=120)
            search = Search(client, tmp_path, n_trials=1)
            search.start()
            folder = tmp_path / "checkpoints" / "trial-0"
            _wait_for_steps(folder, 4)
            ((_, _, job),) = _started(folder)
            slurm.run("scancel", job).check_returncode()
            (trial,) = search.trials()
    finally:
        api.down(record.name)
    _assert_resumed(trial, folder, job)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("main", "argv0", "loaded", "expected"),
    [
        ("distributed.cli.dask_worker", "/venv/bin/python", (), True),  # a batch job's
        ("dask_cuda.cli", "/venv/bin/python", (), True),  # a GPU job's
        (None, "/venv/bin/dask", ("dask_cuda.cli",), True),  # a pod's `dask cuda worker`
        (None, "/venv/bin/dask", (), False),  # `dask scheduler`
        (
            None,
            "/venv/bin/clusterkit",
            ("distributed.cli.dask_worker",),
            False,
        ),  # nannies of its own
    ],
)
def test_only_a_dask_worker_commands_process_passes_sigterm_on(
    monkeypatch: pytest.MonkeyPatch,
    main: str | None,
    argv0: str,
    loaded: tuple[str, ...],
    expected: bool,
) -> None:
    import types

    from clusterkit.runners import graceful

    module = types.ModuleType("__main__")
    module.__spec__ = None if main is None else types.SimpleNamespace(name=main)  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", module)
    monkeypatch.setattr(sys, "argv", [argv0, "worker"])
    for name in graceful.COMMANDS:
        if name in loaded:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    assert graceful.in_worker_command() is expected
