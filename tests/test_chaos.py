"""Chaos: SIGKILL the supervisor (which hosts the scheduler on local and slurm), a worker, the
driver, or on SSH the remote scheduler or the SSH connections, at a seeded random moment of
`up`, `scale` or a search, on the local, ssh, slurm, sge and kubernetes backends (Kubernetes: the
`up` or search process, or a pod's scheduler or worker process). Then nothing of the cluster may
be left after `down` (processes, remote processes and folders, batch jobs), `ls` must agree
with what runs, and a search holds each trial once.

Replay one case with ``CLUSTERKIT_CHAOS_SEED=<seed> pytest tests/test_chaos.py -k "local and
case7"``; ``CLUSTERKIT_CHAOS_KILLS`` sets how many cases per backend (CI: 10). ``bench/chaos.py``
runs more. Grid Engine runs 3 cases (``CLUSTERKIT_CHAOS_SGE_KILLS`` sets more) and Kubernetes 5
(``CLUSTERKIT_CHAOS_K8S_KILLS``): a case there takes 1-2 minutes on 2 cores.

Detached runs (``hpo --detach`` on a cluster from `up`, local and slurm): the run's driver is
SIGKILLed once or twice at seeded moments; its monitor must restart it, the run end succeeded
with the kills counted, the study hold each trial once. One case per backend
(``CLUSTERKIT_CHAOS_DRIVER_KILLS`` sets more; replay with ``-k "detached_driver_local and
case0"``).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from clusterkit import state
from tests import sge as SGE
from tests import slurm as SLURM
from tests import sshd as SSHD
from tests.test_kubernetes import Harness, clean, k8s, write_profile  # noqa: F401 - fixtures
from tests.test_slurm import empty_queue_after  # noqa: F401 - fixture
from tests.test_ssh import Lab, lab, no_remote_leftovers  # noqa: F401 - fixtures

pytestmark = pytest.mark.chaos

SEED = int(os.environ.get("CLUSTERKIT_CHAOS_SEED", "20261124"))
KILLS = int(os.environ.get("CLUSTERKIT_CHAOS_KILLS", "10"))
SGE_KILLS = int(os.environ.get("CLUSTERKIT_CHAOS_SGE_KILLS", min(KILLS, 3)))
K8S_KILLS = int(os.environ.get("CLUSTERKIT_CHAOS_K8S_KILLS", min(KILLS, 5)))
PHASES = ("up", "scale", "hpo")
VICTIMS = {
    "local": ("supervisor", "worker", "driver"),
    "ssh": ("supervisor", "scheduler", "worker", "driver", "connection"),
    "slurm": ("supervisor", "worker", "driver"),
    "sge": ("supervisor", "worker", "driver"),
    "kubernetes": ("scheduler", "worker", "driver"),
}
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
    study = hpo.run(objective, n_trials=n, client=get_client(name, timeout=30), storage=storage,
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


def cases(seed: int, count: int, backend: str = "local") -> list[Case]:
    """Every phase x victim once (as far as ``count`` goes), then seeded random picks."""
    rng = random.Random(f"{seed}-{backend}")
    victims = VICTIMS[backend]
    grid = [(p, v) for v in victims for p in PHASES]
    rng.shuffle(grid)
    picks = grid + [(rng.choice(PHASES), rng.choice(victims)) for _ in range(count)]
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


@dataclass
class Target:
    """One backend under chaos: its profile, how to kill its remote parts, what it can leave."""

    backend: str
    profile: Path
    scale_to: int
    kill_remote: Callable[[str, str], bool] = lambda victim, name: False
    leftovers: Callable[[str], list[str]] = lambda name: []
    supervised: bool = True  # Kubernetes: the cluster lives in the API server, no supervisor
    recover_after: float = 60.0  # how long a search's cluster may take to answer again


def settled(find: Callable[[], list[str]], seconds: float) -> list[str]:
    """What ``find`` still reports once it reports nothing, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill(target: Target, victim: str, name: str, driver: subprocess.Popen[str]) -> int | None:
    """SIGKILL the victim; the supervisor's pid (to check its group afterwards), if known."""
    supervisor = wait_for(lambda: state.supervisor_pid(name), 20) if target.supervised else None
    if victim == "driver":
        driver.kill()
    elif victim == "supervisor" and supervisor:
        os.kill(supervisor, signal.SIGKILL)
    elif target.kill_remote(victim, name):
        pass
    elif victim == "worker" and supervisor:
        workers = wait_for(lambda: [p for p in group(supervisor) if p.pid != supervisor], 20)
        if workers:
            os.kill(workers[-1].pid, signal.SIGKILL)
    return supervisor


def start_driver(case: Case, name: str, target: Target, storage: str) -> subprocess.Popen[str]:
    profile = target.profile
    if case.phase == "up":
        command = [*CLI, "up", str(profile), "--name", name]
    else:
        up = subprocess.run(
            [*CLI, "up", str(profile), "--name", name], capture_output=True, text=True, timeout=180
        )
        assert up.returncode == 0, up.stderr
        if case.phase == "scale":
            command = [*CLI, "scale", name, str(target.scale_to)]
        else:
            command = [sys.executable, "-c", HPO_DRIVER, name, storage, str(TRIALS)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_search(target: Target, name: str, storage: str) -> None:
    """Run the search to the end (resuming the study), on a fresh cluster if the old one died
    or no longer answers."""
    answers = wait_for(lambda: reachable_or_gone(name), target.recover_after)
    listed = state.read_record(name)
    if not answers or listed is None or not state.is_live(listed):
        subprocess.run([*CLI, "down", name], capture_output=True, timeout=120)
        up = subprocess.run(
            [*CLI, "up", str(target.profile), "--name", name],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert up.returncode == 0, up.stderr
    done = subprocess.run(
        [sys.executable, "-c", HPO_DRIVER, name, storage, str(TRIALS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def reachable_or_gone(name: str) -> bool:
    """The cluster answers, or its record is gone or dead."""
    from clusterkit import api

    record = state.read_record(name)
    if record is None or not state.is_live(record):
        return True
    try:
        api.status(name)
    except Exception:
        return False
    return True


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


def run_case(target: Target, index: int, tmp_path: Path) -> None:
    case = cases(SEED, KILLS, target.backend)[index]
    name = f"ch{target.backend[:2]}{index}"
    where = f"{target.backend} {case} (seed {SEED}, case{index})"
    storage = str(tmp_path / "chaos.optuna.log")  # the runner's default kind: a journal file
    driver = start_driver(case, name, target, storage)
    supervisors = []
    try:
        time.sleep(case.delay)
        supervisors.append(kill(target, case.victim, name, driver))
        try:  # a search must end by itself; `up` or `scale` may wait on a cluster that is gone
            driver.communicate(timeout=180 if case.phase == "hpo" else 30)
        except subprocess.TimeoutExpired:
            assert case.phase != "hpo", f"{where}: the search never ended"
        if case.phase == "hpo":
            finish_search(target, name, storage)
            supervisors.append(state.supervisor_pid(name))
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
        down = subprocess.run([*CLI, "down", name], capture_output=True, text=True, timeout=180)
    assert down.returncode in (0, 2), f"{where}: {down.stderr}"
    left = [str(p.pid) for pid in supervisors for p in group(pid)]
    left += settled(lambda: target.leftovers(name), 30)
    assert left == [], f"{where}: left {left}"
    listed = json.loads(
        subprocess.run([*CLI, "ls", "--json"], capture_output=True, text=True, timeout=60).stdout
    )
    assert [row["name"] for row in listed] == [], f"{where}: ls disagrees with what runs"
    assert not state.record_path(name).exists() and not (state.clusters_dir() / name).exists()
    if case.phase == "hpo":
        check_study(storage)


IDS = [f"case{i}" for i in range(KILLS)]


@pytest.mark.parametrize("index", range(KILLS), ids=IDS)
@pytest.mark.timeout(600)
def test_chaos_local(index: int, tmp_path: Path) -> None:
    profile = tmp_path / "chaos.yaml"
    profile.write_text(
        "backend: local\nworkers: 2\nstart_timeout: 60s\nscheduler: {dashboard: false}\n"
    )
    run_case(Target("local", profile, 3), index, tmp_path)


@pytest.mark.parametrize("index", range(KILLS), ids=IDS)
@pytest.mark.timeout(600)
def test_chaos_ssh(index: int, tmp_path: Path, lab: Lab) -> None:  # noqa: F811
    import yaml

    profile = tmp_path / "chaos-ssh.yaml"
    data = lab.profile("chaos", hosts=["127.0.0.1", "127.0.0.1"]).model_dump(mode="json")
    profile.write_text(yaml.safe_dump({**data, "death_timeout": 10}))

    def kill_remote(victim: str, name: str) -> bool:
        if victim == "connection":  # sshd's per-connection processes: every channel drops
            children = psutil.Process(lab.server.proc.pid).children()
            for child in children:
                child.kill()
            return True
        remote = wait_for(lambda: SSHD.remote_processes([lab.server]), 20) or {}
        wanted = {
            pid
            for pid, cmd in remote.items()
            if ("distributed.Scheduler" in cmd) == (victim == "scheduler")
        }
        for pid in wanted:
            os.kill(pid, signal.SIGKILL)
            if victim == "worker":
                break
        return victim in ("scheduler", "worker")

    def leftovers(name: str) -> list[str]:
        found = [str(pid) for pid in SSHD.remote_processes([lab.server])]
        run = Path.home() / ".clusterkit" / "run"
        return found + [str(p) for p in run.glob(f"{name}-*")] if run.is_dir() else found

    run_case(Target("ssh", profile, 3, kill_remote, leftovers), index, tmp_path)


@pytest.mark.parametrize("index", range(KILLS), ids=IDS)
@pytest.mark.timeout(600)
def test_chaos_slurm(index: int, tmp_path: Path, slurm: SLURM.Slurm) -> None:
    import yaml

    from tests.test_slurm import profile_data

    profile = tmp_path / "chaos-slurm.yaml"
    profile.write_text(yaml.safe_dump({**profile_data(tmp_path), "death_timeout": 10}))

    def jobs(name: str) -> list[str]:
        lines = slurm.run("squeue", "-h", "-o", "%i %j").stdout.splitlines()
        return [line.split()[0] for line in lines if f" ck-{name}-" in line]

    def kill_remote(victim: str, name: str) -> bool:
        if victim != "worker":
            return False
        found = wait_for(lambda: jobs(name), 30)
        if found:
            slurm.run("scancel", "--signal=KILL", "--full", found[0])
        return True

    run_case(Target("slurm", profile, 2, kill_remote, jobs), index, tmp_path)


@pytest.mark.parametrize("index", range(SGE_KILLS), ids=[f"case{i}" for i in range(SGE_KILLS)])
@pytest.mark.timeout(600)
def test_chaos_sge(index: int, tmp_path: Path, sge: SGE.SGE) -> None:
    import yaml

    from tests.test_sge import profile_data

    profile = tmp_path / "chaos-sge.yaml"
    profile.write_text(yaml.safe_dump({**profile_data(tmp_path), "death_timeout": 10}))

    def jobs(name: str) -> list[str]:
        return [line.split()[0] for line in sge.queue() if f" ck-{name}-" in line]

    def kill_remote(victim: str, name: str) -> bool:
        if victim != "worker":
            return False
        found = wait_for(lambda: jobs(name), 30)
        if found:
            sge.run("qdel", "-f", found[0])  # execd SIGKILLs the job's processes
        return True

    run_case(Target("sge", profile, 2, kill_remote, jobs), index, tmp_path)


@pytest.mark.parametrize("index", range(K8S_KILLS), ids=[f"case{i}" for i in range(K8S_KILLS)])
@pytest.mark.timeout(600)
def test_chaos_kubernetes(index: int, tmp_path: Path, clean: Harness) -> None:  # noqa: F811
    """The cluster lives in the API: an `up` killed mid-start must still be found by `down`
    (its claim record), and a pod's process killed leaves the DaskCluster for `down`."""
    profile = write_profile(
        tmp_path, "chaos-k8s", workers=2, start_timeout="120s", death_timeout=10
    )

    def pod_processes(name: str) -> dict[int, str]:
        root = str(clean.directory / "pods")
        found = {}
        for process in psutil.process_iter(["cwd", "cmdline"]):
            cwd = process.info["cwd"] or ""
            if cwd.startswith(root) and Path(cwd).name.startswith(f"{name}-"):
                found[process.pid] = " ".join(process.info["cmdline"] or [])
        return found

    def kill_remote(victim: str, name: str) -> bool:
        wanted = "scheduler" if victim == "scheduler" else "worker"
        found = wait_for(lambda: [p for p, cmd in pod_processes(name).items() if wanted in cmd], 30)
        if found:
            os.kill(found[0], signal.SIGKILL)
        return victim in ("scheduler", "worker")

    def leftovers(name: str) -> list[str]:
        left = [f"pid {pid}" for pid in pod_processes(name)]
        left += [
            f"daskcluster/{c['metadata']['name']}"
            for c in clean.objects("daskclusters")
            if c["metadata"]["name"] == name
        ]
        return left + [
            f"pod/{p['metadata']['name']}"
            for p in clean.objects("pods", "v1")
            if p["metadata"].get("labels", {}).get("dask.org/cluster-name") == name
        ]

    target = Target(
        "kubernetes", profile, 3, kill_remote, leftovers, supervised=False, recover_after=15.0
    )
    run_case(target, index, tmp_path)


# ------------------------------------------------------------------ detached runs' drivers

#: Seeded cases per backend of SIGKILLs of a detached search's driver (its monitor restarts it).
DRIVER_KILLS = int(os.environ.get("CLUSTERKIT_CHAOS_DRIVER_KILLS", "1"))
RUN_TRIALS = 24
RUN_OBJECTIVE = textwrap.dedent("""
    import time

    def objective(trial):
        x = trial.suggest_float("x", -1, 1)
        time.sleep(0.3)
        return x * x
""")


def driver_kills(seed: int, index: int, backend: str) -> list[float]:
    """1 or 2 moments (seconds after each driver's start) to SIGKILL the detached driver at."""
    rng = random.Random(f"{seed}-{backend}-detached-{index}")
    return [round(rng.uniform(0.0, 3.0), 2) for _ in range(rng.choice((1, 2)))]


def run_detached_case(
    backend: str, profile: Path, index: int, tmp_path: Path, leftovers: Callable[[str], list[str]]
) -> None:
    """`hpo --detach` on a cluster from `up`; its driver SIGKILLed at the seeded moments: the
    run ends succeeded with each kill counted as a restart, the study holds each trial once,
    and nothing is left once the run ended and the cluster is down."""
    import optuna

    from clusterkit.runners.hpo.inputs import ATTR_ORPHANED, counted, resolve_storage
    from clusterkit.runs.records import get

    moments = driver_kills(SEED, index, backend)
    name = f"chrun{backend[:2]}{index}"
    where = (
        f"{backend}: detached driver killed {', '.join(f'{m:.2f}s' for m in moments)} after "
        f"its start(s) (seed {SEED}, case{index})"
    )
    (tmp_path / "search.py").write_text(RUN_OBJECTIVE)
    storage = str(tmp_path / "chaos.optuna.log")

    def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout
        )

    up = cli("up", str(profile), "--name", name)
    assert up.returncode == 0, f"{where}: {up.stderr}"
    killed: list[int] = []
    supervisor = state.supervisor_pid(name)
    try:
        search = ["search.py:objective", "--trials", str(RUN_TRIALS), "--study-name", "chaos"]
        started = cli("hpo", *search, "--storage", storage, "-p", name, "--detach")
        assert started.returncode == 0, f"{where}: {started.stderr}"
        run_id = started.stdout.strip()
        for moment in moments:
            pid = wait_for(
                lambda: (
                    (r := get(run_id)).state == "running"
                    and r.driver_pid not in (None, *killed)
                    and r.driver_pid
                ),
                60,
            )
            assert pid, f"{where}: no new driver started: {get(run_id)}"
            time.sleep(moment)
            assert not get(run_id).final, f"{where}: the run ended before the kill"
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        waited = cli("runs", "wait", run_id, "--timeout", "150")
        log = cli("runs", "logs", run_id).stdout
        assert waited.returncode == 0, f"{where}: {waited.stderr}\n{log[-3000:]}"
        info = json.loads(cli("runs", "show", run_id, "--json").stdout)
        assert info["state"] == "succeeded", f"{where}: {info}"
        assert info["restarts"] == len(killed), f"{where}: {info}"
        assert info["restart_reasons"] == [f"driver pid {p} killed by SIGKILL" for p in killed]
        assert info["progress"] == f"{RUN_TRIALS}/{RUN_TRIALS}", f"{where}: {info}"
        assert not state.pid_alive(info["monitor_pid"]), f"{where}: the monitor outlived its run"
        left = [p.pid for pid in [*killed, info["driver_pid"]] for p in group(pid)]
        assert left == [], f"{where}: the drivers' process groups left {left}"
    finally:
        down = cli("down", name)
    assert down.returncode == 0, f"{where}: {down.stderr}"
    left_after = [str(p.pid) for p in group(supervisor)] + settled(lambda: leftovers(name), 30)
    assert left_after == [], f"{where}: left {left_after}"
    assert json.loads(cli("ls", "--json").stdout) == [], f"{where}: ls disagrees with what runs"
    trials = optuna.load_study(
        study_name="chaos", storage=resolve_storage(storage, "chaos")
    ).get_trials()
    kept = [t for t in trials if counted(t)]
    assert len(kept) == RUN_TRIALS, f"{where}: {len(kept)} of {RUN_TRIALS} trials counted"
    assert all(t.state.name == "COMPLETE" for t in kept), f"{where}: {trials}"
    assert len({t.number for t in kept}) == RUN_TRIALS, f"{where}: a trial is held twice"
    # what a killed driver had in flight is failed as an orphan, never counted, never RUNNING
    orphans = [t for t in trials if t.user_attrs.get(ATTR_ORPHANED)]
    assert all(t.state.name == "FAIL" for t in orphans), f"{where}: {orphans}"
    assert len(trials) == RUN_TRIALS + len(orphans), f"{where}: {trials}"


DRIVER_IDS = [f"case{i}" for i in range(DRIVER_KILLS)]


@pytest.mark.parametrize("index", range(DRIVER_KILLS), ids=DRIVER_IDS)
@pytest.mark.timeout(600)
def test_chaos_detached_driver_local(index: int, tmp_path: Path) -> None:
    profile = tmp_path / "chaos.yaml"
    profile.write_text(
        "backend: local\nworkers: 2\nworker: {threads: 1}\nstart_timeout: 60s\n"
        "scheduler: {dashboard: false}\n"
    )
    run_detached_case("local", profile, index, tmp_path, lambda name: [])


@pytest.mark.parametrize("index", range(DRIVER_KILLS), ids=DRIVER_IDS)
@pytest.mark.timeout(600)
def test_chaos_detached_driver_slurm(index: int, tmp_path: Path, slurm: SLURM.Slurm) -> None:
    import yaml

    from tests.test_slurm import profile_data

    profile = tmp_path / "chaos-slurm.yaml"
    profile.write_text(yaml.safe_dump(profile_data(tmp_path, workers=2, death_timeout=10)))

    def jobs(name: str) -> list[str]:
        lines = slurm.run("squeue", "-h", "-o", "%i %j").stdout.splitlines()
        return [line.split()[0] for line in lines if f" ck-{name}-" in line]

    run_detached_case("slurm", profile, index, tmp_path, jobs)
