"""GPU tier of the HPO runner: one trial per GPU on dask-cuda workers. Skips without a GPU."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import gpu_skip_reason

REASON = gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hpo_digits_cnn.py"


def test_digits_search_runs_one_trial_per_gpu(tmp_path: Path) -> None:
    import optuna

    import clusterkit
    from clusterkit.backends.local import gpu_inventory
    from clusterkit.runners import hpo
    from clusterkit.runners.hpo.inputs import ATTR_WORKER, load_objective

    gpus, _ = gpu_inventory()
    profile = tmp_path / "cuda.yaml"
    profile.write_text(
        textwrap.dedent("""
        backend: local-cuda
        protocol: tcp
        scheduler: {host: 127.0.0.1}
    """)
    )
    with clusterkit.cluster(profile) as (_, client):
        study = hpo.run(
            load_objective(f"{EXAMPLE}:objective"),
            n_trials=2 * len(gpus),
            client=client,
            storage=optuna.storages.InMemoryStorage(),
            direction="maximize",
            resources={"GPU": 1},
            progress=False,
            out=str(tmp_path / "out"),
        )
    trials = study.get_trials()
    assert len(trials) == 2 * len(gpus)
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert all(t.user_attrs["device"] == "cuda" for t in trials)
    assert len({t.user_attrs[ATTR_WORKER] for t in trials}) == len(gpus)
    assert (tmp_path / "out" / "timeline.png").is_file()
