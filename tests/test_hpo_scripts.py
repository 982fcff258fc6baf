"""Optuna scripts run as written (``tests/optuna_scripts``, in the shape of Optuna's own
examples): ``study.optimize`` in their ``__main__``, or inside a library (``OptunaSearchCV``),
runs its trials on the cluster, every slot busy, and what the script prints afterwards is
printed. Multi-objective, constraints with NSGA-II's generations, pruning and scikit-learn's
search each keep what Optuna keeps."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from clusterkit.runners.hpo.script import run_script

pytestmark = [pytest.mark.local, pytest.mark.seam]  # seam: Optuna's own example scripts
SCRIPTS = Path(__file__).parent / "optuna_scripts"


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from tests.clusters import local_client

    with local_client(2) as connected:
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


@pytest.mark.skipif(
    not hasattr(optuna.trial.Trial, "set_constraint"),
    reason="constrained.py is written for Optuna 5's trial.set_constraint; Optuna 4's "
    "constraints_func runs in test_a_samplers_function_defined_in_the_script_reaches_the_workers",
)
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


# ---------------------------------------------------------------------- clusterkit hpo SCRIPT.py


def _clusterkit(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clusterkit", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_clusterkit_hpo_runs_a_script_as_python_would(tmp_path: Path) -> None:
    shutil.copy(SCRIPTS / "quadratic_two_objectives.py", tmp_path)
    done = _clusterkit(tmp_path, "hpo", "quadratic_two_objectives.py", "--no-progress", "--", "9")
    assert done.returncode == 0, done.stderr
    assert "Number of finished trials: 9" in done.stdout  # its argument, its prints
    assert re.search(r"Pareto trial #\d+", done.stdout)
    assert (tmp_path / "quadratic_two_objectives-results" / "report.html").is_file()


def test_a_script_that_fails_after_its_search_exits_1_with_its_own_traceback(
    tmp_path: Path,
) -> None:
    (tmp_path / "fails.py").write_text(
        "import optuna\n"
        "def objective(trial):\n"
        "    return trial.suggest_float('x', 0, 1)\n"
        "if __name__ == '__main__':\n"
        "    optuna.create_study().optimize(objective, n_trials=2)\n"
        "    raise ValueError('after the search')\n"
    )
    done = _clusterkit(tmp_path, "hpo", "fails.py", "--no-progress")
    assert done.returncode == 1
    trace = done.stderr[done.stderr.index("Traceback") :].splitlines()
    assert trace[1].strip().startswith('File "fails.py", line 6')  # from the script's frame
    assert trace[-1] == "ValueError: after the search"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["run.py", "--trials", "5"], "--trials is the script's own"),
        (["run.py", "--directions", "minimize", "maximize"], "--direction(s) is the script's"),
        (["run.py:objective"], "--trials N is required for FILE.py:FUNC"),
        (["run.py:objective", "-n", "2", "--", "x"], "arguments after -- are for a script"),
        (["missing.py"], "script 'missing.py' does not exist"),
    ],
)
def test_a_script_or_an_objective_with_the_others_flags_is_one_line(
    tmp_path: Path, args: list[str], said: str
) -> None:
    shutil.copy(SCRIPTS / "quadratic_two_objectives.py", tmp_path / "run.py")
    done = _clusterkit(tmp_path, "hpo", *args)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
    assert not (tmp_path / "run-results").exists()  # nothing started


def test_a_detached_script_runs_and_its_output_is_in_its_logs(tmp_path: Path) -> None:
    shutil.copy(SCRIPTS / "quadratic_two_objectives.py", tmp_path)
    started = _clusterkit(tmp_path, "hpo", "quadratic_two_objectives.py", "-d", "--", "7")
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip()
    assert _clusterkit(tmp_path, "runs", "wait", run_id).returncode == 0
    logs = _clusterkit(tmp_path, "runs", "logs", run_id).stdout
    assert "Number of finished trials: 7" in logs


def test_a_samplers_function_defined_in_the_script_reaches_the_workers(tmp_path: Path) -> None:
    """As Optuna's ``quadratic_constraint.py`` writes it: the sampler holds a function of the
    script's ``__main__`` (its ``constraints_func``), which the workers cannot import."""
    (tmp_path / "constrained_tpe.py").write_text(
        "import optuna\n"
        "def objective(trial):\n"
        "    return trial.suggest_float('x', -1, 1) ** 2\n"
        "def constraints(trial):\n"
        "    return (trial.params['x'] - 0.5,)\n"
        "if __name__ == '__main__':\n"
        "    study = optuna.create_study(sampler=optuna.samplers.TPESampler(\n"
        "        constraints_func=constraints, n_startup_trials=2))\n"
        "    study.optimize(objective, n_trials=6)\n"
        "    print('constrained:', sum('constraints' in t.system_attrs for t in study.trials))\n"
    )
    done = _clusterkit(tmp_path, "hpo", "constrained_tpe.py", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "constrained: 6" in done.stdout
