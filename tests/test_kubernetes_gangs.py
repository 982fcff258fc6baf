"""Gang (multi-rank) trials on a Kubernetes cluster from the real dask-kubernetes operator (the
emulator harness of tests/k8s): ``ranks_per_trial=2`` on two worker pods."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract import gang_search_contract
from tests.test_kubernetes import Harness, clean, k8s, write_profile  # noqa: F401 - fixtures

pytestmark = pytest.mark.kubernetes


@pytest.mark.timeout(600)
def test_gang_search_two_ranks_per_trial_on_two_pods(
    clean: Harness,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    for seen in gang_search_contract(write_profile(tmp_path, "k8s-gangs", workers=2)):
        pids = [rank[6] for rank in seen]
        assert len(set(pids)) == 2, f"both ranks in one process: {pids}"
