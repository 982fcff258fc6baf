"""Chaos on the local backend: SIGKILL the supervisor (which hosts the scheduler), a worker or
the driver at a seeded random moment of `up`, `scale` or a search; then nothing of the cluster
may be left after `down`, `ls` must agree with what runs, and a search holds each trial once.

Replay one case with ``CLUSTERKIT_CHAOS_SEED=<seed> pytest tests/test_chaos.py -k case7``;
``CLUSTERKIT_CHAOS_KILLS`` sets how many cases (CI: 12). ``bench/chaos.py`` runs more.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from clusterkit import state

pytestmark = pytest.mark.chaos

SEED = int(os.environ.get("CLUSTERKIT_CHAOS_SEED", "20261124"))
KILLS = int(os.environ.get("CLUSTERKIT_CHAOS_KILLS", "12"))
PHASES = ("up", "scale", "hpo")
VICTIMS = ("supervisor", "worker", "driver")
TRIALS = 10
CLI = [sys.executable, "-m", "clusterkit"]

HPO_DRIVER = textwrap.dedent("""
    import sys, time
    from clusterkit import get_client
    from clusterkit.runners import hpo

    def objective(trial):
        x = trial.suggest_float("x", -1, 1)
        time.sleep(0.3)
        return x * x

    name, storage, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    study = hpo.run(objective, n_trials=n, client=get_client(name), storage=storage,
                    study_name="chaos", progress=False)
    print(len(study.trials))
""")


@dataclass(frozen=True)
class Case:
    phase: str
    victim: str
    delay: float

    def __str__(self) -> str:
        return f"kill the {self.victim} {self.delay:.2f}s into {self.phase}"


def cases(seed: int, count: int) -> list[Case]:
    """Every phase x victim once, then seeded random picks; delays seeded too."""
    rng = random.Random(seed)
    grid = [(p, v) for p in PHASES for v in VICTIMS]
    picks = grid + [(rng.choice(PHASES), rng.choice(VICTIMS)) for _ in range(count)]
    return [Case(p, v, round(rng.uniform(0.0, 2.5), 2)) for p, v in picks[:count]]


def group(pid: int | None) -> list[psutil.Process]:
    """The live processes of the supervisor's process group."""
    if pid is None:
        return []
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def wait_for(predicate, seconds: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return None


def kill(victim: str, name: str, driver: subprocess.Popen[str]) -> int | None:
    """SIGKILL the victim; the supervisor's pid (to check its group afterwards), if known."""
    supervisor = wait_for(lambda: state.supervisor_pid(name), 20)
    if victim == "driver":
        driver.kill()
    elif victim == "supervisor" and supervisor:
        os.kill(supervisor, signal.SIGKILL)
    elif victim == "worker" and supervisor:
        workers = wait_for(lambda: [p for p in group(supervisor) if p.pid != supervisor], 20)
        if workers:
            os.kill(workers[-1].pid, signal.SIGKILL)
    return supervisor


def start_driver(case: Case, name: str, profile: Path, storage: str) -> subprocess.Popen[str]:
    if case.phase == "up":
        command = [*CLI, "up", str(profile), "--name", name]
    else:
        up = subprocess.run([*CLI, "up", str(profile), "--name", name], capture_output=True,
                            text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        if case.phase == "scale":
            command = [*CLI, "scale", name, "3"]
        else:
            command = [sys.executable, "-c", HPO_DRIVER, name, storage, str(TRIALS)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_search(name: str, profile: Path, storage: str) -> None:
    """Run the search to the end (resuming the study), on a fresh cluster if the old one died."""
    listed = state.read_record(name)
    if listed is None or not state.is_live(listed):
        subprocess.run([*CLI, "down", name], capture_output=True, timeout=120)
        up = subprocess.run([*CLI, "up", str(profile), "--name", name], capture_output=True,
                            text=True, timeout=120)
        assert up.returncode == 0, up.stderr
    done = subprocess.run([sys.executable, "-c", HPO_DRIVER, name, storage, str(TRIALS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def check_study(storage: str) -> None:
    import optuna

    from clusterkit.runners.hpo.inputs import resolve_storage

    study = optuna.load_study(study_name="chaos", storage=resolve_storage(storage, "chaos"))
    finished = [t for t in study.trials if t.state.is_finished()]
    states = {t.state.name for t in study.trials}
    assert len(finished) >= TRIALS, f"{len(finished)} of {TRIALS} finished: {states}"
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers)), "a trial is held twice"
    assert not [t for t in study.trials if t.state.name == "RUNNING"], "a trial left RUNNING"


@pytest.mark.parametrize("index", range(KILLS), ids=[f"case{i}" for i in range(KILLS)])
@pytest.mark.timeout(600)
def test_chaos(index: int, tmp_path: Path) -> None:
    case = cases(SEED, KILLS)[index]
    name = f"chaos{index}"
    profile = tmp_path / "chaos.yaml"
    profile.write_text("backend: local\nworkers: 2\nstart_timeout: 60s\n"
                       "scheduler: {dashboard: false}\n")
    storage = str(tmp_path / "chaos.optuna.log")  # the runner's default kind: a journal file
    driver = start_driver(case, name, profile, storage)
    supervisors = []
    try:
        time.sleep(case.delay)
        supervisors.append(kill(case.victim, name, driver))
        driver.communicate(timeout=300)
        if case.phase == "hpo":
            finish_search(name, profile, storage)
            supervisors.append(state.supervisor_pid(name))
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
        down = subprocess.run([*CLI, "down", name], capture_output=True, text=True, timeout=120)
    assert down.returncode in (0, 2), f"{case} (seed {SEED}): {down.stderr}"
    left = [p for pid in supervisors for p in group(pid)]
    assert left == [], f"{case} (seed {SEED}): left running {left}"
    listed = json.loads(subprocess.run([*CLI, "ls", "--json"], capture_output=True, text=True,
                                       timeout=60).stdout)
    assert [row["name"] for row in listed] == [], f"{case}: ls disagrees with what runs"
    assert not state.record_path(name).exists() and not (state.clusters_dir() / name).exists()
    if case.phase == "hpo":
        check_study(storage)
