"""Which workers a cluster counts as lost (:mod:`clusterkit.backends.jobqueue.losses`): one
whose process dies while it runs is; one retired, or closing by itself (its lifetime's end),
is not. On a real
LocalCluster (its workers have no batch job; the multinode tier checks jobs and nodes)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from clusterkit.backends.jobqueue.losses import LostWorkers
from clusterkit.backends.jobqueue.slurm import SlurmQueue

pytestmark = pytest.mark.local


def test_a_killed_worker_is_lost_and_a_retired_or_closed_one_is_not() -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(
        n_workers=3, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0"
    ) as cluster:
        plugin = LostWorkers(cluster, SlurmQueue())
        cluster.scheduler.add_plugin(plugin, name=plugin.name)
        with Client(cluster) as client:
            client.wait_for_workers(3)
            for address in list(cluster.scheduler.workers):  # joined before the plugin
                plugin.add_worker(cluster.scheduler, address)
            pids = client.run(os.getpid)
            killed, retired, closed = sorted(pids)
            name = str(cluster.scheduler.workers[killed].name)
            client.retire_workers([retired])
            # as at its lifetime's end: the worker closes by itself, gracefully
            client.run(lambda dask_worker: dask_worker.loop.add_callback(
                dask_worker.close_gracefully), workers=[closed])  # fmt: skip
            os.kill(pids[killed], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while killed in cluster.scheduler.workers or closed in cluster.scheduler.workers:
                assert time.monotonic() < deadline, list(cluster.scheduler.workers)
                time.sleep(0.1)
            time.sleep(0.5)
    (loss,) = cluster.losses
    assert (loss.worker, loss.job, loss.why) == (name, "", "its connection closed")
    assert loss.line().startswith(f"worker {name} on host 127.0.0.1 at ")
