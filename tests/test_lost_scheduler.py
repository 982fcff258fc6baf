"""A cluster that is gone is noticed at once: a client of a `down` cluster closes instead of
reconnecting, a connection to a scheduler that died is refused with the cluster named."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

import clusterkit
from clusterkit import api
from clusterkit.client import connect
from clusterkit.errors import ClusterNotFound

pytestmark = pytest.mark.local

PROFILE = "backend: local\nworkers: 1\nscheduler: {dashboard: false}\n"


def test_a_client_of_a_cluster_taken_down_closes_instead_of_reconnecting(
    tmp_path: Path,
) -> None:
    """distributed retries a lost scheduler for the client's whole timeout (here 300 s)."""
    (tmp_path / "gone.yaml").write_text(PROFILE)
    api.up(tmp_path / "gone.yaml")
    client = clusterkit.get_client("gone", timeout=300)
    try:
        api.down("gone")
        deadline = time.monotonic() + 60
        while client.status != "closed" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.status == "closed"
    finally:
        client.close()


def test_a_scheduler_that_died_refuses_with_the_cluster_named(tmp_path: Path) -> None:
    (tmp_path / "died.yaml").write_text(PROFILE)
    record = api.up(tmp_path / "died.yaml")
    assert record.pid is not None
    try:
        os.kill(record.pid, signal.SIGKILL)  # the scheduler runs in the supervisor
        psutil.wait_procs([psutil.Process(record.pid)], timeout=10)
        with pytest.raises(ClusterNotFound, match=r"'died' does not answer.*refuses connections"):
            connect(record, timeout=300)
    finally:
        api.down("died")


def test_a_search_whose_cluster_is_taken_down_says_how_to_resume(tmp_path: Path) -> None:
    """The search's client closes with its cluster; the loop's clean-up must not talk to it
    (before: ``ClosedClientError`` from unsubscribing and cancelling hid this message)."""
    import threading

    import optuna

    from clusterkit.errors import ClusterkitError
    from clusterkit.runners import hpo

    (tmp_path / "mid.yaml").write_text(PROFILE)
    api.up(tmp_path / "mid.yaml")
    client = clusterkit.get_client("mid", timeout=300)

    def objective(trial: optuna.Trial) -> float:
        time.sleep(0.2)
        return trial.suggest_float("x", 0.0, 1.0)

    down = threading.Timer(3.0, api.down, args=("mid",))
    down.start()
    try:
        with pytest.raises(ClusterkitError, match="lost the cluster mid-search"):
            hpo.run(
                objective,
                n_trials=10_000,
                client=client,
                storage=optuna.storages.InMemoryStorage(),
                progress=False,
                workdir=None,
            )
    finally:
        down.join()
        client.close()
