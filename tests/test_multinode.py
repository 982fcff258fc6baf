"""clusterkit on a multi-node SLURM (tests/multinode.py): a login node and three compute nodes,
each a network namespace with its own host name and address on one bridge.

Everything runs as a user would run it on the login node: ``clusterkit`` and Python
subprocesses entered into the login node's namespaces (this process stays outside, and has no
route to any node). One SLURM serves the tier; one three-worker cluster serves the tests that
only read it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import multinode as M
from tests.multinode import ROOT, clusterkit, nothing_left, on_login, profile, python

pytestmark = pytest.mark.multinode

# ------------------------------------------------------------------ one cluster, three nodes


@pytest.fixture(scope="module")
def three(nodes: M.MultiNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`clusterkit up` of three worker jobs, shared by the tests that only read it; the env
    (its own state directory) the tests reach it with."""
    directory = tmp_path_factory.mktemp("three")
    # no spare rank processes kept on the workers after a DDP run: they would outlive the test
    # that ran it (the leftover check), the cluster being the module's
    env = {"CLUSTERKIT_STATE_DIR": str(directory / "state"), "CLUSTERKIT_DDP_SPARES": "0"}
    done = clusterkit(nodes, "up", str(profile(directory, "three")), "--name", "three", env=env)
    assert done.returncode == 0, done.stderr[-3000:] + nodes.log()
    try:
        yield env
    finally:
        clusterkit(nodes, "down", "three", env=env)
        nodes.empty_queue()


def test_workers_run_on_three_nodes_and_status_names_them(
    nodes: M.MultiNode, three: dict[str, str]
) -> None:
    jobs = {line.split()[0]: line.split()[2] for line in nodes.queue()}
    assert sorted(jobs.values()) == list(M.NODES), nodes.queue()
    done = clusterkit(nodes, "status", "three", env=three)
    assert done.returncode == 0, done.stderr
    assert f"tls://{M.address(M.LOGIN)}:" in done.stdout, done.stdout
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in done.stdout.splitlines()]
    rows = [row for row in cells if row and row[0] == "job"]  # job, id, state, "n1 (worker x)"
    named = {row[1]: tuple(row[3].rstrip(")").split(" (worker ")) for row in rows}
    assert {job: node for job, (node, _) in named.items()} == jobs, done.stdout
    assert sorted(worker for _, worker in named.values()) == ["three-0", "three-1", "three-2"]


GET_CLIENT = """
    import json, socket, sys
    import clusterkit
    client = clusterkit.get_client(sys.argv[1])
    hosts = client.gather(client.map(lambda _: socket.gethostname(), range(60), pure=False))
    addresses = list(client.scheduler_info(n_workers=-1)["workers"])
    print(json.dumps({"me": socket.gethostname(), "hosts": sorted(set(hosts)),
                      "scheduler": client.scheduler.address, "workers": sorted(addresses)}))
"""


def test_get_client_from_the_login_node_reaches_three_hosts(
    nodes: M.MultiNode, three: dict[str, str]
) -> None:
    seen = python(nodes, GET_CLIENT, "three", env=three)
    assert seen["me"] == M.LOGIN
    assert seen["hosts"] == list(M.NODES), seen
    assert seen["scheduler"].startswith(f"tls://{M.address(M.LOGIN)}:")
    hosts = sorted(address.split("//")[1].rsplit(":", 1)[0] for address in seen["workers"])
    assert hosts == [M.address(node) for node in M.NODES], seen


CONTRACT = """
    import json, sys
    from clusterkit import api, get_client
    from tests import contract
    name = sys.argv[1]
    assert contract.fresh_process_result(name) == "42"
    client = get_client(name)
    assert client.submit(lambda x: x * 2, 21).result(timeout=60) == 42
    info = api.status(name)
    assert len(info["workers"]) == 3 and "scheduler" in api.logs(name)
    with contract.shipped_by_value():
        contract.runners(client)  # a DDP run over the three nodes, then a search
    client.close()
    print(json.dumps("ok"))
"""


def test_contract_body_passes_across_nodes(nodes: M.MultiNode, three: dict[str, str]) -> None:
    assert python(nodes, CONTRACT, "three", env=three) == "ok"


def test_down_leaves_nothing_on_any_node(nodes: M.MultiNode, three: dict[str, str]) -> None:
    done = clusterkit(nodes, "down", "three", env=three)
    assert done.returncode == 0, done.stderr
    nothing_left(nodes)


# ------------------------------------------------------------------ DDP over two nodes


TRAIN = """\
import json, os, socket, subprocess, sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "GROUP_WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
seen = {name: os.environ.get(name) for name in names}
interface = os.environ.get("GLOO_SOCKET_IFNAME") or "lo"
seen["interface_addresses"] = subprocess.run(
    ["ip", "-o", "-4", "addr", "show", "dev", interface], capture_output=True, text=True
).stdout
seen.update(host=socket.gethostname(), sum=value.item())
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(seen))
dist.destroy_process_group()
"""


def test_train_four_ranks_over_two_nodes(nodes: M.MultiNode, tmp_path: Path) -> None:
    """Two jobs of two worker processes: torchrun's layout for 2 nodes x 2 ranks, the master
    on rank 0's node address, gloo on the interface that carries each worker's address."""
    (tmp_path / "project").mkdir()
    script = tmp_path / "project" / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    path = profile(tmp_path, "ddp", workers=4, processes=2, cores=2, memory="2GiB")  # 2 jobs
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    done = clusterkit(
        nodes, "train", str(script), "-p", str(path), "-n", "4", "--timeout", "240",
        "--", str(out), env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]
    hosts = [r["host"] for r in ranks]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # torchrun: ranks by node
    assert set(hosts) <= set(M.NODES)
    for rank, seen in enumerate(ranks):
        assert seen["sum"] == 10.0, seen  # 1 + 2 + 3 + 4
        assert seen["MASTER_ADDR"] == M.address(hosts[0]), seen
        assert seen["GLOO_SOCKET_IFNAME"] == seen["NCCL_SOCKET_IFNAME"] == M.INTERFACE, seen
        assert f"inet {M.address(seen['host'])}/" in seen["interface_addresses"], seen
        layout = {
            **{"RANK": rank, "WORLD_SIZE": 4, "LOCAL_RANK": rank % 2, "LOCAL_WORLD_SIZE": 2},
            **{"GROUP_RANK": rank // 2, "GROUP_WORLD_SIZE": 2},  # torchrun's for 2 nodes x 2
        }
        assert {name: seen[name] for name in layout} == {k: str(v) for k, v in layout.items()}
    nothing_left(nodes)


# ------------------------------------------------------------------ a node dies mid-search


def test_a_node_dies_mid_search(nodes: M.MultiNode, tmp_path: Path) -> None:
    """Every process of node n3 killed mid-search, its slurmd included: `status` shows its
    job's worker lost; the search finishes on n1 and n2 with each trial once in the study;
    SLURM marks n3 down; `down` leaves nothing."""
    import optuna

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "objective.py").write_text(M.OBJECTIVE)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    done = clusterkit(nodes, "up", str(profile(tmp_path, "dies")), "--name", "dies", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    objective = f"{tmp_path / 'project' / 'objective.py'}:objective"
    command = [*nodes.enter(), sys.executable, "-m", "clusterkit", "hpo", objective,
               "-p", "dies", "-n", "24", "--storage", storage, "--study-name", "dies",
               "--no-progress"]  # fmt: skip
    search = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, **nodes.env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while {t.user_attrs.get("host") for t in M.trials(storage, "dies")} < set(M.NODES):
            assert search.poll() is None, search.communicate()[0]
            assert time.monotonic() < deadline, "no trial ran on every node"
            time.sleep(0.2)
        (n3_job,) = [job for job, _, node, name in map(str.split, nodes.queue())
                     if node == "n3" and name.startswith("ck-dies-")]  # fmt: skip
        assert nodes.kill_node("n3"), "nothing ran on n3"
        killed_at = time.time()
        deadline = time.monotonic() + 30
        while True:  # the scheduler notices the worker's connection closed
            status = clusterkit(nodes, "status", "dies", env=env).stdout
            row = next(line for line in status.splitlines() if f"│ {n3_job} " in line)
            if "not connected" in row or time.monotonic() > deadline:
                break
        print(f"`status` {time.time() - killed_at:.1f}s after n3 died:\n{status}")
        assert "n3 (worker dies-" in row and ", not connected)" in row, status
        output, _ = search.communicate(timeout=240)
        took = time.time() - killed_at
        print(f"search ended {took:.1f}s after n3 died; it printed (exit {search.returncode}):")
        print(output)
        assert search.returncode == 0, output
        trials = M.trials(storage, "dies")
        assert len(trials) == 24 and [t.number for t in trials] == list(range(24))
        complete = optuna.trial.TrialState.COMPLETE
        assert all(t.state == complete for t in trials), [t.state for t in trials]
        after = [t for t in trials if t.datetime_start.timestamp() > killed_at + 1]
        assert after and all(t.user_attrs["host"] != "n3" for t in after)
        started = time.monotonic()
        done = clusterkit(nodes, "down", "dies", env=env)
        print(f"`down` took {time.monotonic() - started:.1f}s: {done.stdout}{done.stderr}")
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 60  # `down` does not wait for it: SlurmdTimeout (10 s)
        while not nodes.node_states().get("n3", "").startswith("down"):
            assert time.monotonic() < deadline, nodes.node_states()
            time.sleep(0.5)
        print(f"SLURM marked n3 down within {time.time() - killed_at:.1f}s after it died")
        nothing_left(nodes)
    finally:
        if search.poll() is None:
            search.kill()
            search.communicate()
        clusterkit(nodes, "down", "dies", env=env)
        nodes.revive_node("n3")


# ------------------------------------------------------------------ a node cut off mid-training


SNAPSHOT_TRAIN = """\
import json, os, socket, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
snapshot = Path(os.environ["CLUSTERKIT_CHECKPOINT_DIR"], "snapshot.pt")
state = torch.load(snapshot) if snapshot.exists() else {"epochs_run": 0, "runs": []}
hosts = [None] * world
dist.all_gather_object(hosts, socket.gethostname())
state["runs"].append({"started_at": state["epochs_run"], "hosts": hosts})
for epoch in range(state["epochs_run"], int(sys.argv[1])):
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    time.sleep(0.5)
    state["epochs_run"] = epoch + 1
    if rank == 0:
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, snapshot.with_suffix(".tmp"))
        os.replace(snapshot.with_suffix(".tmp"), snapshot)
dist.destroy_process_group()
"""


def _snapshot(directory: Path) -> dict[str, Any]:
    import torch

    try:
        return dict(torch.load(directory / "snapshot.pt"))
    except (OSError, EOFError, RuntimeError):  # not written yet
        return {"epochs_run": 0, "runs": []}


class Lines:
    """A process's output lines as they come, each with the time it came (``since``)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        import threading

        self.process = process
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float) -> str:
        self.process.wait(timeout=timeout)
        self.thread.join(timeout=10)
        return "\n".join(line for _, line in self.lines)

    def since(self, start: float) -> str:
        return "\n".join(f"{when - start:+7.1f}s  {line}" for when, line in self.lines)


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_node_cut_off_mid_training(nodes: M.MultiNode, tmp_path: Path, restarts: int) -> None:
    """4 ranks over 2 of 3 nodes; the link of the node of ranks 2 and 3 goes down mid-run.
    The training neither hangs nor tracebacks: one line naming that node; with a restart it
    resumes from its snapshot on the nodes that remain."""
    (tmp_path / "project").mkdir()
    script = tmp_path / "project" / "train.py"
    script.write_text(SNAPSHOT_TRAIN)
    checkpoints = tmp_path / "ckpt"
    path = profile(tmp_path, "cut", workers=6, processes=2, cores=2, memory="2GiB")  # 3 jobs
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state"), "CLUSTERKIT_DDP_SPARES": "0"}
    command = [*nodes.enter(), sys.executable, "-m", "clusterkit", "train", str(script),
               "-p", str(path), "-n", "4", "--max-restarts", str(restarts),
               "--checkpoint-dir", str(checkpoints), "--", "40"]  # fmt: skip
    training = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **nodes.env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, cut = Lines(training), None
    try:
        deadline = time.monotonic() + 180
        while _snapshot(checkpoints)["epochs_run"] < 3:
            assert training.poll() is None, output.wait(10)
            assert time.monotonic() < deadline, "training did not reach epoch 3"
            time.sleep(0.2)
        hosts = _snapshot(checkpoints)["runs"][0]["hosts"]
        assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
        cut = hosts[2]
        nodes.cut_node(cut)
        cut_at = time.monotonic()
        text = output.wait(timeout=300)
        took = time.monotonic() - cut_at
        print(f"train --max-restarts {restarts}: {cut} cut off at 0.0s; "
              f"exit {training.returncode} at {took:.1f}s; it printed:")  # fmt: skip
        print(output.since(cut_at))
        assert "Traceback" not in text, text
        named = [line for line in text.splitlines() if f" on node {cut} " in line]
        assert named, text  # the node is named
        state = _snapshot(checkpoints)
        if restarts == 0:
            assert training.returncode == 1, text
            # ranks 2 and 3 both ran on the cut node: whichever the driver heard of first
            assert re.match(r"error: rank [23] failed: worker \S+ on node ", named[-1]), text
            assert state["epochs_run"] < 40
            return
        assert training.returncode == 0, text
        _, second = state["runs"]
        assert state["epochs_run"] == 40
        assert second["started_at"] >= 3 and cut not in second["hosts"], state["runs"]
        assert len(set(second["hosts"])) == 2, second  # the two nodes that remain
    finally:
        if training.poll() is None:
            training.kill()
        output.wait(timeout=30)
        if cut is not None:
            nodes.reconnect_node(cut)
        nodes.wait_idle(timeout=120)
        assert not nodes.empty_queue(), nodes.queue()
        nothing_left(nodes)


# ------------------------------------------------------------------ down after a node died


def test_down_after_a_node_died(nodes: M.MultiNode, tmp_path: Path) -> None:
    """Every process of n3 killed (its slurmd too), then `down` at once, with a site's
    SlurmdTimeout (300 s): SLURM keeps n3's job COMPLETING until the node is back; `down`
    says so in one line, ends with exit 0 and leaves nothing on the nodes that live."""
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    nodes.set_slurmd_timeout(300)
    try:
        done = clusterkit(nodes, "up", str(profile(tmp_path, "gone")), "--name", "gone", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        (n3_job,) = [job for job, _, node, _ in map(str.split, nodes.queue()) if node == "n3"]
        assert nodes.kill_node("n3")
        started = time.monotonic()
        done = clusterkit(nodes, "down", "gone", env=env)
        took = time.monotonic() - started
        print(f"`down` after n3 died: exit {done.returncode} in {took:.1f}s; it printed:")
        print(done.stdout + done.stderr)
        print(f"queue after it: {nodes.queue()}; nodes: {nodes.node_states()}")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        stuck = [line for line in done.stderr.splitlines() if n3_job in line]
        assert len(stuck) == 1 and "node n3 " in stuck[0], done.stderr
        assert [line.split()[:3] for line in nodes.queue()] in ([], [[n3_job, "COMPLETING", "n3"]])
        assert not any(nodes.processes(node) for node in ("n1", "n2")), nodes.queue()
        assert clusterkit(nodes, "status", "gone", env=env).returncode != 0  # no record left
    finally:
        clusterkit(nodes, "down", "gone", env=env)
        nodes.revive_node("n3")
        nodes.set_slurmd_timeout(10)
        nothing_left(nodes)


# ------------------------------------------------------------------ gang trials across nodes


GANGS = """
    import json, socket, sys, time
    import optuna
    import torch.distributed as dist
    import clusterkit
    from clusterkit.runners import hpo

    def objective(trial):
        dist.init_process_group("gloo")
        x = trial.suggest_float("x", 0, 1)
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, [socket.gethostname(), x])
        dist.destroy_process_group()
        trial.set_user_attr("seen", seen)
        return x

    client = clusterkit.get_client(sys.argv[1])
    found, took = {}, {}
    for placement in ("pack", "spread"):
        started = time.monotonic()
        study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
        hpo.run(objective, n_trials=2, client=client, study=study, progress=False,
                workdir=None, ranks_per_trial=2, placement=placement)
        found[placement] = [
            [t.state.name, t.params["x"], t.user_attrs["seen"]] for t in study.trials
        ]
        took[placement] = round(time.monotonic() - started, 1)
    print(took, file=sys.stderr)
    print(json.dumps(found))
"""


def test_gang_trials_pack_and_spread_over_two_nodes(nodes: M.MultiNode, tmp_path: Path) -> None:
    """2 nodes x 2 rank slots (two jobs of two workers): ``placement="pack"`` keeps a 2-rank
    gang on one node, ``"spread"`` puts it on both; every rank of a trial sees its parameters.
    (``placement`` is an ``hpo.run`` option: no CLI flag or profile field yet.)"""
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    path = profile(tmp_path, "gangs", workers=4, processes=2, cores=2, memory="2GiB")
    started = time.monotonic()
    done = clusterkit(nodes, "up", str(path), "--name", "gangs", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"up: {time.monotonic() - started:.1f}s")
    try:
        done = on_login(nodes, sys.executable, "-c", textwrap.dedent(GANGS), "gangs", env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        print(f"searches took (s): {done.stderr.strip().splitlines()[-1]}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        for case, trials in found.items():
            for state, x, seen in trials:
                assert state == "COMPLETE", found
                assert [value for _, value in seen] == [x] * len(seen), found  # same params
                hosts = [host for host, _ in seen]
                assert set(hosts) <= set(M.NODES), found
                wanted = 1 if case == "pack" else 2
                assert len(set(hosts)) == wanted, (case, found)
    finally:
        done = clusterkit(nodes, "down", "gangs", env=env)
        assert done.returncode == 0, done.stderr
        nothing_left(nodes)


# ------------------------------------------------------------------ --batch over three nodes


def test_batch_search_over_a_three_node_allocation(nodes: M.MultiNode, tmp_path: Path) -> None:
    """`hpo --batch` of 6 one-task workers of 2 cores on 3 nodes of 4: one job spanning the
    three nodes, its trials on every node; `runs wait` ends 0 and `runs` shows it."""
    import optuna

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "objective.py").write_text(M.OBJECTIVE)
    storage = f"sqlite:///{tmp_path / 'batch.db'}"
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    path = profile(tmp_path, "batch", workers=6, cores=2, memory="1GiB")
    objective = f"{tmp_path / 'project' / 'objective.py'}:objective"
    done = clusterkit(nodes, "hpo", objective, "-p", str(path), "-n", "18", "--storage", storage,
                      "--study-name", "dies", "--batch", env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = done.stdout.strip().splitlines()[-1]
    waiting = subprocess.Popen(
        [*nodes.enter(), sys.executable, "-m", "clusterkit", "runs", "wait", run_id,
         "--timeout", "240"],
        cwd=tmp_path, env={**os.environ, **nodes.env(), **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    names, spans = set(), set()  # job names in the queue; the nodes of the running ones
    while waiting.poll() is None:
        for _, state, *where, name in map(str.split, nodes.queue()):
            names.add(name)
            spans.update(where if state == "RUNNING" else ())
        time.sleep(0.5)
    output = waiting.communicate()[0]
    print(f"queue while it ran: jobs {names} on {spans}")
    assert waiting.returncode == 0, output
    assert names == {f"ck-{run_id}"} and spans == {"n[1-3]"}, (names, spans)
    trials = optuna.load_study(study_name="dies", storage=storage).get_trials()
    assert len(trials) == 18 and all(t.state.name == "COMPLETE" for t in trials)
    assert {t.user_attrs["host"] for t in trials} == set(M.NODES), trials
    listed = clusterkit(nodes, "runs", env=env)
    row = next(line for line in listed.stdout.splitlines() if run_id in line)
    assert "succeeded" in row and "18/18" in row, listed.stdout
    nothing_left(nodes)
