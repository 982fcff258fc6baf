"""Optuna scripts run as written (``tests/optuna_scripts``, in the shape of Optuna's own
examples): ``study.optimize`` in their ``__main__``, or inside a library (``OptunaSearchCV``),
runs its trials on the cluster, every slot busy, and what the script prints afterwards is
printed. Multi-objective, constraints with NSGA-II's generations, pruning and scikit-learn's
search each keep what Optuna keeps."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from clusterkit.runners.hpo.script import run_script

pytestmark = pytest.mark.local
SCRIPTS = Path(__file__).parent / "optuna_scripts"


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as connected,
    ):
        connected.wait_for_workers(2, timeout=60)
        yield connected


def _run(client: Any, name: str, *argv: str) -> list[Any]:
    return run_script(str(SCRIPTS / name), argv, client=client, progress=False, workdir=None)


def _workers(study: Any) -> set[str]:
    return {t.user_attrs["ck_worker"] for t in study.trials if "ck_worker" in t.user_attrs}


def test_a_two_objective_script_prints_its_pareto_front(client: Any, capsys: Any) -> None:
    (study,) = _run(client, "quadratic_two_objectives.py", "24")
    out = capsys.readouterr().out
    assert "Number of finished trials: 24" in out
    front = re.findall(r"Pareto trial #(\d+)", out)
    assert front and sorted(map(int, front)) == sorted(t.number for t in study.best_trials)
    assert len(_workers(study)) == 2


def test_constraints_and_nsga2s_generations_are_kept(client: Any, capsys: Any) -> None:
    (study,) = _run(client, "constrained.py")
    out = capsys.readouterr().out
    generations = re.search(r"generations: \[([\d, ]+)\]", out)
    assert generations is not None and len(generations.group(1).split(",")) >= 3, out
    assert all(any(k.startswith("constraints:") for k in t.system_attrs) for t in study.trials)
    feasible = int(re.search(r"feasible: (\d+) of 32", out).group(1))  # type: ignore[union-attr]
    assert 0 < feasible < 32


def test_a_pruning_script_prunes_and_prints_its_statistics(client: Any, capsys: Any) -> None:
    (study,) = _run(client, "pruning_iris.py")
    out = capsys.readouterr().out
    numbers = re.search(r"finished: 30 pruned: (\d+) complete: (\d+)", out)
    assert numbers is not None, out
    pruned = len(study.get_trials(states=(optuna.trial.TrialState.PRUNED,)))
    assert int(numbers.group(1)) == pruned > 0


def test_optuna_search_cv_calls_optimize_itself_and_runs_on_the_cluster(
    client: Any, capsys: Any
) -> None:
    (study,) = _run(client, "search_cv.py")
    out = capsys.readouterr().out
    assert "trials: 12" in out
    assert "workers: 2" in out
    assert float(re.search(r"best score: ([\d.]+)", out).group(1)) > 0.9  # type: ignore[union-attr]
    assert all("mean_test_score" in t.user_attrs for t in study.trials)  # numpy floats, kept
