"""Real LocalClusters that the tests of one module share: started once, for tests that only use
the cluster (a test that kills, restarts or adds workers keeps a cluster of its own).

Between tests a shared cluster is put back as a new one would be: the rank processes its
workers keep for DDP runs and gang trials (spares, warm ranks) end after each test and start
again before the next, as on a cluster that was just connected to, and the workers'
environment is restored. So the per-test leftover check (``conftest.no_leftover_processes``)
still sees every process a test starts, and a cluster's own processes are checked once it
closes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import cloudpickle

from tests.conftest import fail_on_leftovers, token_processes

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import tests/


@contextlib.contextmanager
def local_client(n_workers: int, dashboard: bool = False, threads: int = 1) -> Iterator[Any]:
    """A client of a LocalCluster of ``n_workers`` worker processes of ``threads`` threads on
    127.0.0.1; fails when a process it started outlives it."""
    from distributed import Client, LocalCluster

    baseline = token_processes()
    with (
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0" if dashboard else None,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(n_workers, timeout=60)
        yield client
    fail_on_leftovers(baseline, "shared cluster")


def _environ() -> dict[str, str]:
    return dict(os.environ)


def _restore_environ(saved: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(saved)


def _start_spare(dask_worker: Any) -> None:
    from clusterkit.runners.ddp import pool

    pool.ensure_spare(dask_worker)


@contextlib.contextmanager
def as_new(client: Any, rank_processes: bool = False) -> Iterator[Any]:
    """``client``'s shared cluster for one test, put back afterwards (see the module doc).
    ``rank_processes``: the test runs DDP ranks, so each worker's spare starts first, as when
    ``ddp`` meets a cluster for the first time."""
    from clusterkit.runners.ddp import pool
    from clusterkit.runners.ddp.driver import prepare

    saved = client.run(_environ)
    if rank_processes:
        prepare(client)  # registers the spares' plugin, once per client
        client.run(_start_spare)  # the spare that the last test's teardown ended
    try:
        yield client
    finally:
        client.run(pool.end_all)  # spares and warm ranks, as a closing cluster ends them
        for worker, environ in saved.items():
            client.run(_restore_environ, environ, workers=[worker])
