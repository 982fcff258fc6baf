"""The one contract every backend passes, with the same workloads everywhere.

``run_contract``: up -> ls -> get_client in a fresh process -> submit -> scale -> status ->
logs -> both runners (a search and a DDP run) -> down -> nothing left behind.
``run_embedded_contract``: get_client() without `up` -> the same workloads -> close -> nothing
left. ``run_attach_contract``: an ``address`` profile attaches to a running cluster and runs
the same workloads. Backend test modules call these; the functions the runners execute are
shipped by value, so remote hosts need not import this module.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from clusterkit import api, state
from clusterkit.client import get_client

FRESH_PROCESS = textwrap.dedent("""
    import sys, clusterkit
    client = clusterkit.get_client(sys.argv[1])
    print(client.submit(sum, [20, 22]).result(timeout=60))
    client.close()
""")


def fresh_process_result(name: str, env: dict[str, str] | None = None) -> str:
    """Run get_client(NAME) + one task in a brand-new Python process; return its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, name],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def ddp_train(ctx: Any) -> int:
    """Each rank contributes 1: the sum is the world size."""
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return int(value.item())


def objective(trial: Any) -> float:
    x = trial.suggest_float("x", -3, 3)
    return float((x - 1) ** 2)


def runners(client: Any) -> None:
    """Both runners, unchanged, on whatever cluster the client reaches."""
    import optuna

    from clusterkit.runners import ddp, hpo

    size = len(api.scheduler_identity(client)["workers"])
    assert ddp.run(ddp_train, client=client, timeout=120) == [size] * size
    # a fresh study each time: a journal in the working directory would be resumed by the
    # next backend's contract, which would then run no trial at all
    storage = optuna.storages.InMemoryStorage()
    study = hpo.run(objective, n_trials=4, client=client, storage=storage, progress=False)
    assert len(study.get_trials(states=[optuna.trial.TrialState.COMPLETE])) == 4


@contextlib.contextmanager
def shipped_by_value() -> Iterator[None]:
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def run_contract(
    profile: Any,
    *,
    name: str | None = None,
    scale_to: int | None = None,
    workloads: tuple[Callable[[Any], None], ...] = (runners,),
    env: dict[str, str] | None = None,
) -> state.ClusterRecord:
    """Bring the profile up and take it through every verb; returns the (gone) record."""
    record = api.up(profile, name=name)
    name = record.name
    try:
        assert state.read_record(name) is not None
        assert any(row["name"] == name for row in api.list_clusters())
        assert fresh_process_result(name, env) == "42"
        client = get_client(name)
        try:
            assert client.submit(lambda x: x * 2, 21).result(timeout=60) == 42
            if scale_to is not None:
                api.scale(name, scale_to)
                assert len(api.scheduler_identity(client)["workers"]) == scale_to
            info = api.status(name)
            assert info["address"] == record.address and info["workers"]
            assert "scheduler" in api.logs(name)
            with shipped_by_value():
                for workload in workloads:
                    workload(client)
        finally:
            client.close()
    finally:
        api.down(name)
    assert state.read_record(name) is None, "down left the record behind"
    assert not state.pid_alive(record.pid), "down left the supervisor running"
    return record


def run_embedded_contract(
    profile: Any, *, workloads: tuple[Callable[[Any], None], ...] = (runners,)
) -> None:
    """get_client() starts the cluster in this process; closing the client ends it."""
    before = {record.name for record in state.records()}
    client = get_client(profile)
    try:
        assert client.submit(lambda x: x * 2, 21).result(timeout=60) == 42
        with shipped_by_value():
            for workload in workloads:
                workload(client)
    finally:
        client.close()
    del client  # an embedded remote cluster's record goes with its client object
    import gc

    gc.collect()
    after = {record.name for record in state.records()}
    assert after == before, "an embedded cluster must leave no record"


def run_attach_contract(address_profile: Any) -> None:
    """An ``address`` profile attaches to a running scheduler and runs the same workloads."""
    run_embedded_contract(address_profile)


DETACHED_SEARCH = """
import time

def objective(trial):
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.2)
    return x * x
"""


def run_detached_contract(
    directory: Any,
    profile: Any,
    name: str,
    study: str,
    still_up: Callable[[], None],
    timeouts: tuple[int, int],
) -> None:
    """`up` the profile as ``name``, `hpo --detach -p NAME` (6 trials), `runs wait` exits 0,
    the study holds each trial once, `runs` shows it succeeded on the cluster, the cluster is
    still up (``still_up`` checks the backend's own view), then `down`. ``timeouts``: seconds
    for `runs wait`, and for each command."""
    wait, timeout = timeouts
    import json

    import optuna

    from clusterkit.runners.hpo.inputs import counted, resolve_storage

    (directory / "search.py").write_text(DETACHED_SEARCH)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "clusterkit", *args]
        return subprocess.run(
            command, cwd=directory, capture_output=True, text=True, timeout=timeout
        )

    up = cli("up", str(profile), "--name", name)
    assert up.returncode == 0, up.stderr
    try:
        search = ["search.py:objective", "--trials", "6", "--study-name", study]
        started = cli("hpo", *search, "-p", name, "--detach")
        assert started.returncode == 0, started.stderr
        run_id = started.stdout.strip()
        assert run_id.startswith("hpo-"), started.stdout
        waited = cli("runs", "wait", run_id, "--timeout", str(wait))
        log = cli("runs", "logs", run_id).stdout
        assert waited.returncode == 0, f"{waited.stderr}\n{log[-3000:]}"
        assert f"{run_id}: succeeded" in waited.stderr
        storage = resolve_storage(str(directory / f"{study}.optuna.log"), study)
        trials = optuna.load_study(study_name=study, storage=storage).get_trials()
        kept = [t for t in trials if counted(t)]
        assert len(kept) == 6 and all(t.state.name == "COMPLETE" for t in kept), trials
        assert len(trials) == 6 and len({t.number for t in trials}) == 6
        (row,) = json.loads(cli("runs", "--json").stdout)
        assert row["id"] == run_id and row["state"] == "succeeded", row
        assert row["target"] == f"cluster {name}" and row["progress"] == "6/6"
        assert row["restarts"] == 0
        listed = json.loads(cli("ls", "--json").stdout)
        assert [r["name"] for r in listed] == [name], listed
        still_up()
    finally:
        down = cli("down", name)
    assert down.returncode == 0, down.stderr


def gang_objective(trial: Any) -> float:
    """Every rank: the same params, world size 2, an all_reduce; rank 0 records what each saw
    (a mismatch raises on every rank, failing the trial)."""
    import torch
    import torch.distributed as dist

    x = trial.suggest_float("x", 0.0, 1.0)
    n = trial.suggest_int("n", 1, 1000)
    dist.init_process_group("gloo")  # left initialised: the runner destroys it
    total = torch.ones(1)
    dist.all_reduce(total)
    mine = [x, n, dist.get_world_size(), int(total.item()), os.environ.get("WORLD_SIZE")]
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, [*mine, os.environ.get("SLURM_JOB_ID"), os.getpid()])
    if any(other[:5] != mine for other in seen):
        raise ValueError(f"ranks disagree: {seen}")
    trial.set_user_attr("seen", seen)
    return x


def gang_search(client: Any, n_trials: int) -> Any:
    import optuna

    from clusterkit.runners import hpo

    study = optuna.create_study(
        storage=optuna.storages.InMemoryStorage(), sampler=optuna.samplers.RandomSampler(seed=5)
    )
    return hpo.run(
        gang_objective,
        n_trials=n_trials,
        client=client,
        study=study,
        progress=False,
        workdir=None,
        ranks_per_trial=2,
        max_retries=0,  # a rank that fails shows its error, not a retry
    )


def assert_gangs_of_two(study: Any, n_trials: int) -> list[list[Any]]:
    """Every trial COMPLETE, on two distinct workers, both ranks the same params and world size
    2; the ranks' records (rank order) per trial."""
    from clusterkit.runners.hpo.inputs import ATTR_GANG

    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * n_trials, [
        (t.state.name, t.user_attrs) for t in trials
    ]
    records = []
    for trial in trials:
        x, n = trial.params["x"], trial.params["n"]
        seen = trial.user_attrs["seen"]
        assert [r[:5] for r in seen] == [[x, n, 2, 2, "2"]] * 2, seen
        assert trial.value == x
        gang = trial.user_attrs[ATTR_GANG]
        assert len(gang) == 2 and len(set(gang)) == 2, gang
        records.append(seen)
    return records


def gang_search_contract(profile: Any, n_trials: int = 4) -> list[list[Any]]:
    """``up`` a 2-worker cluster from ``profile``, search with ``ranks_per_trial=2`` (gloo),
    ``down``: every trial COMPLETE on two distinct workers, both ranks the same parameters and
    world size 2; what the ranks saw, per trial."""
    record = api.up(profile)
    try:
        with get_client(record.name) as client, shipped_by_value():
            client.wait_for_workers(2, timeout=120)
            study = gang_search(client, n_trials)
    finally:
        api.down(record.name)
    return assert_gangs_of_two(study, n_trials)
