"""Faults across nodes on the multi-node SLURM (tests/multinode.py): the scheduler's node cut
off, a node dying mid-search and its workers replaced, a worker job reaching its walltime
mid-trial. Each runs as a user would on the login node (``clusterkit`` there), says what it
measured (``-s`` shows it) and leaves nothing on any node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import multinode as M
from tests.multinode import clusterkit, nothing_left, profile

pytestmark = pytest.mark.multinode


def worker_processes(nodes: M.MultiNode) -> dict[str, dict[int, str]]:
    """Per node, what runs there for a job besides SLURM's own daemons (slurmd, slurmstepd):
    the job script, the worker and its nanny."""
    found = {}
    for node in M.NODES:
        mine = {p: c for p, c in nodes.processes(node).items() if not c.startswith("slurmstepd")}
        if mine:
            found[node] = mine
    return found


def job_nodes(nodes: M.MultiNode, name: str) -> dict[str, str]:
    """The running jobs of cluster ``name``: job id -> node."""
    return {
        job: node
        for job, state, node, job_name in map(str.split, nodes.queue())
        if state == "RUNNING" and job_name.startswith(f"ck-{name}-")
    }


def lost_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("lost: ")]


def stamp_seconds(line: str, near: float) -> float:
    """The ``at HH:MM:SS`` of a lost line as a ``time.time()`` stamp, on the day of ``near``."""
    stamp = line.split(" at ")[1].split()[0]
    day = time.strftime("%Y-%m-%d ", time.localtime(near))
    return time.mktime(time.strptime(day + stamp, "%Y-%m-%d %H:%M:%S"))


def search(nodes: M.MultiNode, env: dict[str, str], cwd: Path, *args: str) -> subprocess.Popen[str]:
    """``clusterkit hpo ARGS`` on the login node, in the background, its output piped."""
    command = [*nodes.enter(), sys.executable, "-m", "clusterkit", "hpo", *args, "--no-progress"]
    return subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, **nodes.env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=30)


# ------------------------------------------------------------------ the scheduler's node cut off

#: The bound the README states for workers whose scheduler's site is cut off: Dask's TCP
#: timeout (``distributed.comm.timeouts.tcp``, 30 s), then the worker's close; generous here
#: for a loaded machine.
CUT_BOUND = 90.0


def test_the_scheduler_node_cut_off(nodes: M.MultiNode, tmp_path: Path) -> None:
    """The login node (scheduler, supervisor, slurmctld) loses its link: the workers on all
    three nodes end by themselves within the README's bound; once it is back, `status` says
    which workers were lost, where and when, and `down` leaves nothing."""
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    done = clusterkit(nodes, "up", str(profile(tmp_path, "cutoff")), "--name", "cutoff", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    cut = False
    try:
        assert sorted(job_nodes(nodes, "cutoff").values()) == list(M.NODES), nodes.queue()
        assert set(worker_processes(nodes)) == set(M.NODES)
        before = clusterkit(nodes, "status", "cutoff", env=env)
        assert before.returncode == 0 and not lost_lines(before.stdout), before.stdout
        nodes.cut_node(M.LOGIN)
        cut, cut_at, cut_clock = True, time.monotonic(), time.time()
        while worker_processes(nodes):
            assert time.monotonic() - cut_at < CUT_BOUND, worker_processes(nodes)
            time.sleep(0.2)
        took = time.monotonic() - cut_at
        print(f"the last worker process ended {took:.1f}s after the scheduler's node was cut")
        nodes.reconnect_node(M.LOGIN)
        cut = False
        back = time.monotonic()
        nodes.wait_idle(timeout=120, busy=True)
        print(f"SLURM nodes in service again {time.monotonic() - back:.1f}s after the reconnect")
        status = clusterkit(nodes, "status", "cutoff", env=env)
        print(f"`status` after the reconnect (exit {status.returncode}):")
        print(status.stdout + status.stderr)
        assert status.returncode == 0, status.stderr  # the supervisor kept its scheduler
        lost = lost_lines(status.stdout)
        assert len(lost) == 3 and all("(its connection closed)" in line for line in lost), lost
        for node in M.NODES:
            assert sum(f" on node {node} at " in line for line in lost) == 1, status.stdout
        after = sorted(stamp_seconds(line, cut_clock) - cut_clock for line in lost)
        print(f"the scheduler dropped the workers {after[0]:.0f}-{after[-1]:.0f}s after the cut")
        assert after[0] > -1 and after[-1] < CUT_BOUND, after  # stamps in whole seconds
        down = clusterkit(nodes, "down", "cutoff", env=env)
        print(f"`down` (exit {down.returncode}): {down.stdout}{down.stderr}")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "Traceback" not in down.stderr and len(down.stderr.splitlines()) <= 1
        nothing_left(nodes)
    finally:
        if cut:
            nodes.reconnect_node(M.LOGIN)
        clusterkit(nodes, "down", "cutoff", env=env)
        resume_drained(nodes)
        nodes.wait_idle(timeout=120)
        nothing_left(nodes)


def resume_drained(nodes: M.MultiNode) -> None:
    """Back in service the nodes SLURM drained after the cut: it requeued the jobs it had lost
    touch with and, starting them again on nodes that still held their first run, drained
    those nodes ('Duplicate jobid'), as it would at a site; an admin resumes them."""
    drained = [node for node, state in nodes.node_states().items() if state.startswith("drain")]
    if drained:
        nodes.run("scontrol", "update", f"NodeName={','.join(drained)}", "State=RESUME")


# ------------------------------------------------------------------ a dead node's workers replaced


def test_a_dead_nodes_workers_are_replaced_and_status_shows_the_loss(
    nodes: M.MultiNode, tmp_path: Path
) -> None:
    """n3 dies mid-search: `status` shows one line for its lost worker (job, node, time,
    cause); `scale NAME 3` has three workers again, on n1 and n2; the search finishes with
    each trial once; `down` leaves nothing."""
    import optuna

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "objective.py").write_text(M.OBJECTIVE)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    done = clusterkit(nodes, "up", str(profile(tmp_path, "lose")), "--name", "lose", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    objective = f"{tmp_path / 'project' / 'objective.py'}:objective"
    running = search(nodes, env, tmp_path, objective, "-p", "lose", "-n", "30",
                     "--storage", storage, "--study-name", "lose")  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while {t.user_attrs.get("host") for t in M.trials(storage, "lose")} < set(M.NODES):
            assert running.poll() is None, running.communicate()[0]
            assert time.monotonic() < deadline, "no trial ran on every node"
            time.sleep(0.2)
        (n3_job,) = [job for job, node in job_nodes(nodes, "lose").items() if node == "n3"]
        assert nodes.kill_node("n3"), "nothing ran on n3"
        killed_at, clock = time.monotonic(), time.time()
        while True:
            status = clusterkit(nodes, "status", "lose", env=env)
            lost = lost_lines(status.stdout)
            if lost or time.monotonic() - killed_at > 60:
                break
            time.sleep(0.5)
        noticed = time.monotonic() - killed_at
        print(f"`status` {noticed:.1f}s after n3 died:\n{status.stdout}")
        assert status.returncode == 0, status.stderr
        assert len(lost) == 1 and lost[0].startswith("lost: worker lose-"), status.stdout
        assert f" of job {n3_job} on node n3 at " in lost[0], lost
        assert lost[0].endswith("(its connection closed)"), lost
        assert abs(stamp_seconds(lost[0], clock) - clock) < 30, lost  # when it died, not later
        scaled = clusterkit(nodes, "scale", "lose", "3", env=env, timeout=200)
        recovered = time.monotonic() - killed_at
        print(f"`scale lose 3` returned (exit {scaled.returncode}) {recovered:.1f}s after n3 died:"
              f" {scaled.stdout}{scaled.stderr}")  # fmt: skip
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        where = job_nodes(nodes, "lose")
        assert len(where) == 3 and set(where.values()) <= {"n1", "n2"}, nodes.queue()
        status = clusterkit(nodes, "status", "lose", env=env)
        print(f"`status` after `scale`:\n{status.stdout}")
        assert lost_lines(status.stdout) == lost, status.stdout
        output, _ = running.communicate(timeout=300)
        print(f"search ended {time.monotonic() - killed_at:.1f}s after n3 died "
              f"(exit {running.returncode}):\n{output[-1500:]}")  # fmt: skip
        assert running.returncode == 0, output
        trials = M.trials(storage, "lose")
        assert [t.number for t in trials] == list(range(30)), [t.number for t in trials]
        assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        done = clusterkit(nodes, "down", "lose", env=env)
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 60  # n3's job leaves once SLURM marks n3 down
        while not nodes.node_states().get("n3", "").startswith("down"):
            assert time.monotonic() < deadline, nodes.node_states()
            time.sleep(0.5)
        nothing_left(nodes)
    finally:
        stop(running)
        clusterkit(nodes, "down", "lose", env=env)
        nodes.revive_node("n3")
        nothing_left(nodes)


# ------------------------------------------------------------------ walltime mid-trial


#: Steps of a trial: 70 s of work, longer than a worker's life on a 90 s walltime (60 s give
#: or take 7.5 s: the profile's margin, 30 s, and its stagger), so the first attempt is cut
STEPS, STEP_SECONDS = 140, 0.5

STEPWISE = f"""\
import json
import socket
import time

from clusterkit.runners import hpo


def note(folder, what, step):
    line = {{"host": socket.gethostname(), what: step, "at": time.time()}}
    with (folder / "attempts.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\\n")


def objective(trial):
    x = trial.suggest_float("x", -1.0, 1.0)
    folder = hpo.checkpoint_dir(trial)
    saved = folder / "state.json"
    step, total = json.loads(saved.read_text()) if saved.exists() else (0, 0.0)
    note(folder, "started", step)
    while step < {STEPS}:
        if hpo.should_checkpoint():
            saved.write_text(json.dumps([step, total]))
            note(folder, "saved", step)
            raise hpo.TrialInterrupted(f"saved at step {{step}}")
        time.sleep({STEP_SECONDS})
        total += x * x / {STEPS}
        step += 1
    return total
"""


def test_a_worker_job_reaches_its_walltime_mid_trial(nodes: M.MultiNode, tmp_path: Path) -> None:
    """One worker job of a 90 s walltime runs a trial of 70 s; two more jobs, started 20 s
    later on the other nodes, end later. The trial saves its checkpoint as its job's end
    nears and resumes on another node from the step it saved, not from the start."""
    import optuna

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "objective.py").write_text(STEPWISE)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    checkpoints = tmp_path / "ckpt"
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    path = profile(tmp_path, "wall", workers=1, walltime="00:01:30")
    done = clusterkit(nodes, "up", str(path), "--name", "wall", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    up_at = time.monotonic()
    objective = f"{tmp_path / 'project' / 'objective.py'}:objective"
    running = search(nodes, env, tmp_path, objective, "-p", "wall", "-n", "1",
                     "--storage", storage, "--study-name", "wall",
                     "--checkpoint-dir", str(checkpoints))  # fmt: skip
    attempts_file = checkpoints / "trial-0" / "attempts.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not attempts_file.exists():
            assert running.poll() is None, running.communicate()[0]
            assert time.monotonic() < deadline, "the trial did not start"
            time.sleep(0.2)
        time.sleep(max(0.0, 20 - (time.monotonic() - up_at)))
        scaled = clusterkit(nodes, "scale", "wall", "3", env=env, timeout=200)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        print(f"jobs after `scale wall 3`: {job_nodes(nodes, 'wall')}")
        output, _ = running.communicate(timeout=400)
        print(f"search ended {time.monotonic() - up_at:.1f}s after `up` "
              f"(exit {running.returncode}):\n{output[-1500:]}")  # fmt: skip
        assert running.returncode == 0, output
        notes = [json.loads(line) for line in attempts_file.read_text().splitlines()]
        start = notes[0]["at"]
        print("trial 0:", ", ".join(f"{n['at'] - start:.1f}s {n['host']} " + (
            f"started at step {n['started']}" if "started" in n else f"saved step {n['saved']}"
        ) for n in notes))  # fmt: skip
        attempts = [n for n in notes if "started" in n]
        assert len(attempts) >= 2, notes
        first, second = attempts[:2]
        assert first["started"] == 0 and first["host"] in M.NODES, notes
        assert second["host"] in M.NODES and second["host"] != first["host"], notes
        assert 0 < second["started"] < STEPS, notes  # from its checkpoint, not the start
        saved = next(n for n in notes if "saved" in n)
        assert saved["host"] == first["host"] and saved["saved"] == second["started"], notes
        print(f"resumed on {second['host']} {second['at'] - saved['at']:.1f}s after the "
              f"checkpoint on {first['host']}")  # fmt: skip
        assert [a["started"] for a in attempts] == sorted(a["started"] for a in attempts)
        (trial,) = optuna.load_study(study_name="wall", storage=storage).get_trials()
        assert trial.state == optuna.trial.TrialState.COMPLETE
        assert trial.value == pytest.approx(trial.params["x"] ** 2)
        status = clusterkit(nodes, "status", "wall", env=env)
        assert status.returncode == 0 and not lost_lines(status.stdout), status.stdout
        done = clusterkit(nodes, "down", "wall", env=env)
        assert done.returncode == 0, done.stderr
        nothing_left(nodes)
    finally:
        stop(running)
        clusterkit(nodes, "down", "wall", env=env)
        nothing_left(nodes)
