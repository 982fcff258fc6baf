"""What Optuna and sklearn users write every day, shipped to the workers as written (issue 38):
an objective naming ``optuna.integration`` or another lazy module, its warnings pointing at its
own file, output redirected into the project, ``n_jobs=-1`` inside a trial."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from clusterkit.runners import workdir

optuna = pytest.importorskip("optuna")
pytest.importorskip("distributed")

LAZY_MODULE = '''
"""A module that replaces itself with a lazy ModuleType subclass, as transformers and
optuna.integration do: attributes are imported on first use."""
import importlib
import sys
import types


class _LazyModule(types.ModuleType):
    def __getattr__(self, name):
        value = getattr(importlib.import_module("statistics"), name)
        setattr(self, name, value)
        return value


sys.modules[__name__] = _LazyModule(__name__)
'''

OBJECTIVES = {
    "optuna.integration": """
        import optuna


        def objective(trial):
            x = trial.suggest_float("x", -10, 10)
            if trial.number < 0:  # named as Optuna's examples do, never reached
                optuna.integration.OptunaSearchCV
            return (x - 2) ** 2
        """,
    "a lazy module of the project": """
        import lazy_tools


        def objective(trial):
            x = trial.suggest_float("x", -10, 10)
            return (x - lazy_tools.fmean([1.0, 3.0])) ** 2
        """,
}


def clusterkit(
    project: Path, *args: str, env: dict[str, str] | None = None, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clusterkit", *args],
        cwd=project,
        env={**os.environ, **(env or {})},
        text=True,
        timeout=240,
        **kwargs,  # type: ignore[call-overload]
    )


def finished_trials(project: Path, study: str = "obj-objective") -> list[optuna.trial.FrozenTrial]:
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(
        JournalFileBackend(str(project / f"{study}.optuna.log"))
    )
    trials = optuna.load_study(study_name=study, storage=storage).trials
    return [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache for synced copies (the CLI's workers inherit the variable)."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("CLUSTERKIT_WORKDIR_CACHE", str(directory))
    return directory


# ---------------------------------------------------------------- lazy modules


@pytest.mark.unit
def test_modules_of_any_type_travel_by_reference_and_code_keeps_its_file() -> None:
    from clusterkit.runners.workdir.pickling import dumps

    class Lazy(types.ModuleType):
        pass

    importable = sys.modules.setdefault("clusterkit_test_lazy", Lazy("clusterkit_test_lazy"))
    loose = Lazy("clusterkit_test_nowhere")  # in no sys.modules: its attributes go by value
    loose.answer = 42  # type: ignore[attr-defined]

    def uses_both() -> tuple[object, int]:
        return importable, loose.answer  # type: ignore[attr-defined]

    try:
        rebuilt = pickle.loads(dumps(uses_both))
        assert rebuilt()[0] is importable and rebuilt()[1] == 42
        assert rebuilt.__code__.co_filename == __file__
        assert pickle.loads(dumps(optuna.integration)) is optuna.integration
    finally:
        del sys.modules["clusterkit_test_lazy"]


@pytest.mark.local
@pytest.mark.parametrize("names", sorted(OBJECTIVES))
def test_an_objective_naming_a_lazy_module_ships(tmp_path: Path, cache: Path, names: str) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "obj.py").write_text(textwrap.dedent(OBJECTIVES[names]))
    (project / "lazy_tools.py").write_text(LAZY_MODULE)
    done = clusterkit(project, "hpo", "obj.py:objective", "--trials", "2", capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cannot pickle" not in done.stderr
    assert len(finished_trials(project)) == 2


@pytest.mark.local
def test_a_warning_from_the_objective_names_its_file_and_line(tmp_path: Path, cache: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "obj.py").write_text(
        "import warnings\n\n\ndef objective(trial):\n"
        '    warnings.warn("x is far from 2")\n'
        "    return 1.0\n"
    )
    done = clusterkit(project, "hpo", "obj.py:objective", "--trials", "2", capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "<dynamic-code>" not in done.stderr
    assert f"{project / 'obj.py'}:5: UserWarning: x is far from 2" in done.stderr


# ---------------------------------------------------------------- the project in place

WRITES_A_FILE = """
import os


def objective(trial):
    x = trial.suggest_float("x", -10, 10)
    with open(f"out-{trial.number}.txt", "w") as handle:
        handle.write(os.getcwd())
    return (x - 2) ** 2
"""


@pytest.mark.unit
def test_scan_leaves_out_what_this_process_is_writing(tmp_path: Path) -> None:
    (tmp_path / "obj.py").write_text("def objective(trial):\n    return 1.0\n")
    (tmp_path / "data.csv").write_text("a,b\n")
    with open(tmp_path / "run.log", "w") as log, open(tmp_path / "data.csv") as _:
        log.write("started\n")
        log.flush()
        assert [f.path for f in workdir.scan(tmp_path).files] == ["data.csv", "obj.py"]
    assert "run.log" in [f.path for f in workdir.scan(tmp_path).files]


EARLIER_RUN = {  # the study file an earlier `clusterkit hpo` left in the project
    "obj-objective.optuna.log": "optuna.storages.JournalStorage("
    "optuna.storages.journal.JournalFileBackend('obj-objective.optuna.log'))",
    "obj-objective.db": "'sqlite:///obj-objective.db'",
}


@pytest.mark.local
@pytest.mark.parametrize("study_file", sorted(EARLIER_RUN))
def test_the_study_file_of_an_earlier_run_is_no_part_of_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, study_file: str
) -> None:
    """A rerun in the project: the search writes its study file all along, so a worker that
    joins later (one restarted) would find the project changed, and no copy of it anywhere."""
    from clusterkit.runners.hpo import inputs

    (tmp_path / "obj.py").write_text("def objective(trial):\n    return 1.0\n")
    make = f"import optuna; optuna.create_study(storage={EARLIER_RUN[study_file]})"
    subprocess.run([sys.executable, "-c", make], cwd=tmp_path, check=True, timeout=60)
    monkeypatch.chdir(tmp_path)
    scanned = workdir.scan(tmp_path)  # the CLI scans first, before the study is opened
    assert [f.path for f in scanned.files] == sorted(["obj.py", study_file])
    storage = None if study_file.endswith(".log") else f"sqlite:///{study_file}"
    inputs.resolve_storage(storage, "obj-objective")
    project = workdir.resolve(scanned)
    assert project is not None and [f.path for f in project.files] == ["obj.py"]
    assert project.digest == workdir.scan(tmp_path).digest


@pytest.mark.local
def test_output_redirected_into_the_project_keeps_the_trials_there(
    tmp_path: Path, cache: Path
) -> None:
    """``clusterkit hpo obj.py:objective --trials 4 > run.log 2>&1`` in the project."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "obj.py").write_text(WRITES_A_FILE)
    with open(project / "run.log", "w") as log:
        done = clusterkit(
            project,
            "hpo",
            "obj.py:objective",
            "--trials",
            "4",
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    output = (project / "run.log").read_text()
    assert done.returncode == 0, output[-3000:]
    assert sorted(p.name for p in project.glob("out-*.txt")) == [f"out-{n}.txt" for n in range(4)]
    assert {p.read_text() for p in project.glob("out-*.txt")} == {str(project)}
    assert "run in a copy" not in output and not list(cache.glob("projects/*/out-*.txt"))


@pytest.mark.local
def test_a_copy_says_where_in_one_line(tmp_path: Path, cache: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "obj.py").write_text(WRITES_A_FILE)
    done = clusterkit(
        project,
        "hpo",
        "obj.py:objective",
        "--trials",
        "2",
        env={workdir.COPY_ENV: "1"},
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "run in a copy" in line]
    (copy,) = [p for p in cache.glob("projects/project-*") if p.is_dir()]
    assert len(lines) == 1 and str(copy) in lines[0] and str(project) in lines[0], lines
    assert sorted(p.name for p in copy.glob("out-*.txt")) == ["out-0.txt", "out-1.txt"]


# ---------------------------------------------------------------- joblib in a trial

SKLEARN_OBJECTIVE = """
import joblib
from sklearn.datasets import make_classification
from sklearn.ensemble import RandomForestClassifier
from sklearn.model_selection import cross_val_score


def objective(trial):
    X, y = make_classification(n_samples=120, random_state=0)
    depth = trial.suggest_int("max_depth", 2, 6)
    model = RandomForestClassifier(n_estimators=8, max_depth=depth, n_jobs=-1)
    trial.set_user_attr("n_jobs", joblib.effective_n_jobs(-1))
    return cross_val_score(model, X, y, cv=3, n_jobs=-1).mean()
"""


@pytest.mark.local
def test_n_jobs_minus_one_in_a_trial_uses_the_workers_cores(tmp_path: Path, cache: Path) -> None:
    joblib = pytest.importorskip("joblib")
    pytest.importorskip("sklearn")
    cores = joblib.cpu_count()
    if cores < 2:
        pytest.skip("this machine has one core: a worker cannot have more")
    project = tmp_path / "project"
    project.mkdir()
    (project / "obj.py").write_text(SKLEARN_OBJECTIVE)
    (project / "one-worker.yaml").write_text("backend: local\nworkers: 1\nworker: {threads: 1}\n")
    done = clusterkit(
        project,
        "hpo",
        "obj.py:objective",
        "--trials",
        "2",
        "--direction",
        "maximize",
        "--profile",
        "one-worker.yaml",
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "daemon" not in done.stderr and "n_jobs=1" not in done.stderr, done.stderr[-3000:]
    assert [t.user_attrs["n_jobs"] for t in finished_trials(project)] == [cores, cores]
