"""Gang (multi-rank) trials on a real SLURM: ``ranks_per_trial=2`` on two workers in two jobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import slurm as S
from tests.contract import gang_search_contract
from tests.test_slurm import empty_queue_after, profile_file  # noqa: F401 - fixture

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(300)
def test_gang_search_two_ranks_per_trial_in_two_jobs(slurm: S.Slurm, tmp_path: Path) -> None:
    profile = profile_file(tmp_path, "gangs", workers=2, memory="2GiB")
    for seen in gang_search_contract(profile):
        jobs = [rank[5] for rank in seen]
        assert None not in jobs and len(set(jobs)) == 2, f"a gang ran in one job: {jobs}"
