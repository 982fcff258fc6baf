"""The search loop's watchdog: a quiet spell with trials in flight is logged with the
scheduler's view of their tasks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import loop

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def client() -> Iterator[object]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as connected,
    ):
        yield connected


def slow_objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(2.5)
    return x * x


def test_a_quiet_spell_is_logged_with_the_task_states(
    client: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loop, "STALL_AFTER", 1.0)
    with caplog.at_level(logging.WARNING, logger="clusterkit.runners.hpo.loop"):
        study = hpo.run(
            slow_objective,
            n_trials=1,
            client=client,  # type: ignore[arg-type]
            storage=optuna.storages.InMemoryStorage(),
            progress=False,
        )
    assert [t.state.name for t in study.trials] == ["COMPLETE"]
    stalls = [r.getMessage() for r in caplog.records if "no trial finished" in r.getMessage()]
    assert len(stalls) == 1, stalls  # once per quiet spell
    assert "1 in flight" in stalls[0] and ": processing" in stalls[0]
