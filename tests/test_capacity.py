"""One rank formula: what a profile promises equals what the DDP runner places on its workers."""

from __future__ import annotations

from typing import Any

import pytest

from clusterkit.capacity import rank_capacity, ranks_per_worker
from clusterkit.cli.train import _capacity
from clusterkit.schema import MODELS

pytestmark = pytest.mark.unit


def model(data: dict[str, Any]) -> Any:
    return MODELS[data["backend"]].model_validate(data).named("cap")


@pytest.mark.parametrize(
    ("threads", "gpus", "ranks"), [(1, 0, 1), (8, 0, 1), (1, 1, 1), (4, 2, 2), (1, 4, 1)]
)
def test_ranks_per_worker(threads: int, gpus: float, ranks: int) -> None:
    assert ranks_per_worker(threads, gpus) == ranks


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"backend": "local", "workers": 3}, 3),
        ({"backend": "local", "workers": 1, "adapt": {"minimum": 0, "maximum": 5}}, 5),
        # one CUDAWorker per host: a worker per GPU, each owning one -> 4 ranks per host
        ({"backend": "ssh", "hosts": ["a", "b"], "worker": {"gpus": 4}}, 8),
        ({"backend": "ssh", "hosts": ["a", "b"], "workers_per_host": 3}, 6),
        (
            {
                "backend": "slurm",
                "workers": 4,
                "cores": 8,
                "memory": "32GiB",
                "processes": 2,
                "worker": {"gpus": 1},
                "walltime": "01:00:00",
            },
            4,
        ),
        (
            {
                "backend": "kubernetes",
                "workers": 2,
                "worker": {"gpus": 1},
                "worker_groups": [{"name": "cpu", "workers": 3}],
            },
            5,
        ),
    ],
)
def test_profile_capacity_is_the_one_formula(data: dict[str, Any], expected: int) -> None:
    profile = model(data)
    assert profile.rank_capacity() == expected
    assert _capacity(profile) == expected
    assert rank_capacity(profile.worker_shapes()) == expected


def test_attach_profiles_have_no_known_capacity() -> None:
    profile = model({"backend": "address", "address": "tcp://10.0.0.1:8786"})
    assert _capacity(profile) is None
