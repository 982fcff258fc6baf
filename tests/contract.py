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
        capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})},
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
