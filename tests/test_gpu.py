"""GPU tier: dask-cuda workers per GPU, the GPU resource, an RMM pool, UCX. Skips without a GPU."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import gpu_skip_reason

REASON = gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def test_local_cuda_one_worker_per_gpu_with_gpu_resource(tmp_path: Path) -> None:
    import clusterkit
    from clusterkit.backends.local import gpu_inventory

    gpus, _ = gpu_inventory()
    path = tmp_path / "cuda.yaml"
    path.write_text(textwrap.dedent("""
        backend: local-cuda
        protocol: ucx
        rmm_pool_size: 1GiB
        scheduler: {host: 127.0.0.1}
    """))
    with clusterkit.cluster(path) as (_, client):
        workers = client.scheduler_info()["workers"].values()
        assert len(workers) == len(gpus)
        assert all(w["resources"].get("GPU") == 1 for w in workers)

        def device_and_pool() -> tuple[int, str]:
            import rmm
            import torch

            return torch.cuda.device_count(), type(rmm.mr.get_current_device_resource()).__name__

        results = client.run(device_and_pool)
        assert all(count == 1 for count, _ in results.values())
        assert all("Pool" in resource for _, resource in results.values())
        assert client.scheduler.address.startswith("ucx://")
