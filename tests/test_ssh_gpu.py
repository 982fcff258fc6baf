"""dask-cuda workers over SSH (gpu tier: skips, with its reason, on a machine without a GPU)."""

from __future__ import annotations

import os

import pytest

from clusterkit.backends.ssh.backend import SSHBackend
from tests.test_ssh import Lab, lab, no_remote_leftovers, tcp  # noqa: F401 - fixtures

SSH = SSHBackend()

pytestmark = pytest.mark.gpu


def test_gpu_workers_over_ssh(lab: Lab) -> None:  # noqa: F811 - the imported fixture
    from distributed import Client

    from tests.conftest import gpu_skip_reason

    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SSH.create(lab.profile(worker={"gpus": 1}), tcp(), name="test")
    try:
        with Client(cluster) as client:
            client.wait_for_workers(1, timeout=60)
            (worker,) = client.scheduler_info(n_workers=-1)["workers"].values()
            assert worker["resources"] == {"GPU": 1.0}

            def visible_devices() -> str | None:  # runs on the worker
                return os.environ.get("CUDA_VISIBLE_DEVICES")

            seen = client.submit(visible_devices, resources={"GPU": 1})
            assert seen.result(timeout=60) == "0"  # the host's one device, as dask-cuda gives it
    finally:
        cluster.close()
