"""The study's knobs by Optuna's names (``--directions``, ``--sampler``/``--sampler-kwargs``,
``--pruner``/``--pruner-kwargs``): parsed and built as Optuna's CLI does, each mistake one line
(exit 2) before anything starts, the spec round-tripping through its command line, resumes
keeping their directions, and multi-objective results (the Pareto front on stdout, in
``--json`` and in the report); then ``clusterkit hpo`` with them on a real LocalCluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from clusterkit.errors import BadInput
from clusterkit.runners.hpo import knobs

pytestmark = pytest.mark.seam  # Optuna's samplers, pruners and directions from the CLI

optuna.logging.set_verbosity(optuna.logging.WARNING)

unit = pytest.mark.unit
local = pytest.mark.local

OBJECTIVE = """
def objective(trial):
    return trial.suggest_float("x", 0.0, 1.0)
"""

#: Two objectives at odds: every trial is on the Pareto front of (minimize, maximize).
TWO_OBJECTIVES = """
def objective(trial):
    x = trial.suggest_float("x", 0.0, 1.0)
    return x, x
"""

#: Reports its x, so a ThresholdPruner(upper=0.5) prunes the trials above 0.5.
REPORTING = """
import optuna

def objective(trial):
    x = trial.suggest_float("x", 0.0, 1.0)
    trial.report(x, 0)
    if trial.should_prune():
        raise optuna.TrialPruned()
    return x
"""


def journal_study(path: Path, name: str) -> optuna.Study:
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    return optuna.load_study(study_name=name, storage=storage)


# ------------------------------------------------------------------ directions


@unit
@pytest.mark.parametrize(
    ("direction", "directions", "expected"),
    [
        (None, None, None),
        ([], [], None),
        (["maximize"], None, ("maximize",)),
        (None, ["minimize", "maximize"], ("minimize", "maximize")),
        (None, ["maximize"], ("maximize",)),
    ],
)
def test_directions_from_the_flags(
    direction: list[str] | None, directions: list[str] | None, expected: tuple[str, ...] | None
) -> None:
    assert knobs.check_directions(direction, directions) == expected


@unit
@pytest.mark.parametrize(
    ("direction", "directions", "expected"),
    [
        (["minimize", "maximize"], None, "--direction given 2 times"),
        (["minimize", "minimize"], None, "takes --directions minimize minimize"),
        (["minimize"], ["maximize"], "--direction and --directions both given"),
        (["up"], None, "--direction must be minimize or maximize, got 'up'"),
        (None, ["minimize", "down"], "--directions must be minimize or maximize, got 'down'"),
    ],
)
def test_a_second_direction_or_a_bad_one_is_refused(
    direction: list[str] | None, directions: list[str] | None, expected: str
) -> None:
    with pytest.raises(BadInput) as refused:
        knobs.check_directions(direction, directions)
    assert expected in refused.value.one_line()


@unit
def test_the_python_api_takes_direction_or_directions_as_optuna_does() -> None:
    from optuna.study import StudyDirection

    assert knobs.study_directions(None, None) is None
    assert knobs.study_directions("maximize", None) == ["maximize"]
    assert knobs.study_directions(None, ["minimize", StudyDirection.MAXIMIZE]) == [
        "minimize",
        "maximize",
    ]
    for direction, directions, expected in [
        ("minimize", ["maximize"], "not both"),
        (None, "maximize", "takes a list"),
        (None, [], "one or more"),
        ("sideways", None, "got 'sideways'"),
    ]:
        with pytest.raises(BadInput, match=expected):
            knobs.study_directions(direction, directions)


@unit
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--directions", "minimize", "maximize", "s.py:f", "-n", "2"],
            ["--directions", "minimize", "--directions", "maximize", "s.py:f", "-n", "2"],
        ),
        (
            ["s.py:f", "--directions=minimize", "maximize", "--json"],
            ["s.py:f", "--directions", "minimize", "--directions", "maximize", "--json"],
        ),
        (["s.py:f", "--directions", "-n", "2"], ["s.py:f", "--directions", "-n", "2"]),
        (["s.py:f", "--directions"], ["s.py:f", "--directions"]),  # click: needs a value
        (["--direction", "minimize", "s.py:f"], ["--direction", "minimize", "s.py:f"]),
        (["s.py:f", "--", "--directions", "a", "b"], ["s.py:f", "--", "--directions", "a", "b"]),
    ],
)
def test_directions_take_the_words_up_to_the_next_option(
    args: list[str], expected: list[str]
) -> None:
    from clusterkit.cli.hpo import spread_directions

    assert spread_directions(args) == expected


# ------------------------------------------------------------------ samplers and pruners


@unit
def test_the_names_are_optunas_classes() -> None:
    samplers, pruners = knobs.names("sampler"), knobs.names("pruner")
    for name in ("TPESampler", "CmaEsSampler", "NSGAIISampler", "GPSampler", "QMCSampler"):
        assert name in samplers
    for name in ("RandomSampler", "GridSampler", "BruteForceSampler", "PartialFixedSampler"):
        assert name in samplers
    assert "BaseSampler" not in samplers and "BaseGASampler" not in samplers
    assert set(pruners) == {
        "MedianPruner",
        "PercentilePruner",
        "SuccessiveHalvingPruner",
        "HyperbandPruner",
        "ThresholdPruner",
        "PatientPruner",
        "WilcoxonPruner",
        "NopPruner",
    }


@unit
@pytest.mark.parametrize("name", knobs.names("sampler"))
def test_every_sampler_is_made_by_name(name: str) -> None:
    kwargs: dict[str, Any] = {
        "GridSampler": {"search_space": {"x": [0, 1]}},
        "PartialFixedSampler": {"fixed_params": {"x": 1}, "base_sampler": "RandomSampler"},
    }.get(name, {})
    sampler = knobs.make_sampler(name, kwargs)
    assert type(sampler).__name__ == name


@unit
@pytest.mark.parametrize("name", knobs.names("pruner"))
def test_every_pruner_is_made_by_name(name: str) -> None:
    kwargs = {
        "PatientPruner": {"wrapped_pruner": None, "patience": 1},
        "PercentilePruner": {"percentile": 25.0},
        "ThresholdPruner": {"upper": 1.0},
    }.get(name, {})
    assert type(knobs.make_pruner(name, kwargs)).__name__ == name


@unit
def test_the_kwargs_reach_the_class() -> None:
    tpe = knobs.make_sampler("TPESampler", {"multivariate": True, "seed": 1})
    assert tpe._multivariate is True
    grid = knobs.make_sampler("GridSampler", {"search_space": {"x": [1, 2, 3], "k": ["a"]}})
    assert grid._search_space == {"k": ["a"], "x": [1, 2, 3]}
    median = knobs.make_pruner("MedianPruner", {"n_warmup_steps": 5})
    assert median._n_warmup_steps == 5
    assert knobs.make_sampler(None) is None and knobs.make_pruner(None, None) is None


@unit
@pytest.mark.parametrize(
    "wrapped",
    [{"name": "MedianPruner", "kwargs": {"n_warmup_steps": 5}}, {"name": "MedianPruner"}],
)
def test_a_pruner_that_wraps_another_names_it(wrapped: dict[str, Any]) -> None:
    patient = knobs.make_pruner("PatientPruner", {"wrapped_pruner": wrapped, "patience": 2})
    assert isinstance(patient._wrapped_pruner, optuna.pruners.MedianPruner)
    assert patient._wrapped_pruner._n_warmup_steps == wrapped.get("kwargs", {}).get(
        "n_warmup_steps", 0
    )
    assert patient._patience == 2
    by_name = knobs.make_pruner("PatientPruner", {"wrapped_pruner": "NopPruner", "patience": 1})
    assert isinstance(by_name._wrapped_pruner, optuna.pruners.NopPruner)
    cmaes = knobs.make_sampler("CmaEsSampler", {"independent_sampler": "RandomSampler"})
    assert isinstance(cmaes._independent_sampler, optuna.samplers.RandomSampler)


@unit
@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: knobs.make_sampler("TPE", None),
            "--sampler 'TPE' is not one of Optuna's samplers: BruteForceSampler, CmaEsSampler,",
        ),
        (
            lambda: knobs.make_pruner("TPESampler", None),
            "--pruner 'TPESampler' is not one of Optuna's pruners: HyperbandPruner,",
        ),
        (
            lambda: knobs.make_sampler("TPESampler", {"bogus": 1}),
            "--sampler-kwargs for TPESampler: TPESampler.__init__() got an unexpected keyword",
        ),
        (
            lambda: knobs.make_sampler("GridSampler", {}),
            "--sampler-kwargs for GridSampler: GridSampler.__init__() missing 1 required",
        ),
        (
            lambda: knobs.make_pruner("MedianPruner", {"n_startup_trials": -1}),
            "--pruner-kwargs for MedianPruner: Number of startup trials cannot be negative",
        ),
        (lambda: knobs.make_pruner(None, {"upper": 1}), "--pruner-kwargs needs --pruner NAME"),
        (
            lambda: knobs.make_pruner("PatientPruner", {"wrapped_pruner": "Nope", "patience": 1}),
            "--pruner-kwargs wrapped_pruner 'Nope' is not one of Optuna's pruners",
        ),
        (
            lambda: knobs.make_pruner("PatientPruner", {"wrapped_pruner": 3, "patience": 1}),
            """--pruner-kwargs wrapped_pruner must be a pruner's name or {"name": NAME""",
        ),
        (
            lambda: knobs.make_pruner(
                "PatientPruner",
                {"wrapped_pruner": {"name": "MedianPruner", "kwargs": {"x": 1}}, "patience": 1},
            ),
            "--pruner-kwargs wrapped_pruner.kwargs for MedianPruner",
        ),
    ],
)
def test_a_bad_knob_is_one_line_naming_its_flag(make: Any, expected: str) -> None:
    with pytest.raises(BadInput) as refused:
        make()
    line = refused.value.one_line()
    assert line.startswith(expected) and "\n" not in line, line


# ------------------------------------------------------------------ the spec and the command line


@unit
def test_a_spec_with_the_knobs_round_trips_through_its_command_line() -> None:
    from clusterkit.runs.spec import RunSpec, command_line, from_command_line, load

    spec = RunSpec.hpo(
        "/p/search.py:objective",
        trials=8,
        directions=("minimize", "maximize"),
        sampler="TPESampler",
        sampler_kwargs='{"multivariate": true, "seed": 1}',
        pruner="PatientPruner",
        pruner_kwargs={"wrapped_pruner": {"name": "MedianPruner", "kwargs": {}}, "patience": 2},
    )
    assert spec.options.sampler_kwargs == {"multivariate": True, "seed": 1}
    argv = command_line(spec)
    assert argv[3:6] == ["--directions", "minimize", "maximize"]
    assert argv[argv.index("--sampler-kwargs") + 1] == '{"multivariate": true, "seed": 1}'
    assert from_command_line("hpo", argv, cwd=spec.cwd)[0] == spec
    assert load(spec.model_dump(mode="json")) == spec  # as a record holds it
    one = RunSpec.hpo("/p/search.py:objective", trials=2, directions=["maximize"])
    assert command_line(one)[1:] == ["--trials", "2", "--direction", "maximize"]
    assert from_command_line("hpo", command_line(one), cwd=one.cwd)[0] == one


@unit
def test_specs_and_command_lines_recorded_with_one_direction_still_load() -> None:
    from clusterkit.runs.spec import RunSpec, from_command_line, load

    old = {"target": "/p/s.py:f", "cwd": "/p", "options": {"kind": "hpo", "trials": 3}}
    old["options"]["direction"] = "maximize"  # type: ignore[index]
    assert load(old).options.directions == ("maximize",)  # type: ignore[union-attr]
    spec, _ = from_command_line("hpo", ["/p/s.py:f", "--trials", "3", "--direction", "maximize"])
    assert spec.options.directions == ("maximize",)  # type: ignore[union-attr]
    made = RunSpec.hpo("s.py:f", trials=3, direction="maximize")
    assert made.options.directions == ("maximize",)  # type: ignore[union-attr]
    assert made.replaced(direction="minimize").options.directions == ("minimize",)  # type: ignore[union-attr]


@unit
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--direction", "minimize", "--direction", "maximize"], "--direction given 2 times"),
        (["--direction", "minimize", "--directions", "maximize"], "both given"),
        (["--directions", "minimize", "sideways"], "got 'sideways'"),
        (["--sampler-kwargs", "{bad"], "--sampler-kwargs is not JSON"),
        (["--pruner-kwargs", "[1]"], "--pruner-kwargs must be a JSON object, got [1]"),
        (["--sampler-kwargs", '{"seed": 1}'], "--sampler-kwargs needs --sampler NAME"),
    ],
)
def test_a_launched_command_line_refuses_what_the_command_refuses(
    args: list[str], expected: str
) -> None:
    from clusterkit.runs.spec import from_command_line

    with pytest.raises(BadInput) as refused:
        from_command_line("hpo", ["s.py:f", "-n", "2", *args])
    assert expected in refused.value.one_line()


@unit
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--direction", "minimize", "--direction", "maximize"],
            "error: --direction given 2 times (minimize maximize): a study of several objectives "
            "takes --directions minimize maximize",
        ),
        (["--directions", "minimize", "maximize", "--direction", "minimize"], "both given"),
        (["--directions", "minimize", "up"], "--directions must be minimize or maximize"),
        (["--sampler", "Nope"], "--sampler 'Nope' is not one of Optuna's samplers: "),
        (["--sampler", "TPESampler", "--sampler-kwargs", "{"], "--sampler-kwargs is not JSON"),
        (["--sampler", "GridSampler"], "--sampler-kwargs for GridSampler: "),
        (["--pruner", "MedianPruner", "--pruner-kwargs", '{"n": 1}'], "--pruner-kwargs for "),
        (["--pruner-kwargs", '{"upper": 1}'], "--pruner-kwargs needs --pruner NAME"),
    ],
)
def test_the_command_refuses_a_bad_knob_in_one_line_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    from clusterkit.cli import main

    (tmp_path / "search.py").write_text(OBJECTIVE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["hpo", "search.py:objective", "--trials", "2", *args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and err.startswith("error: "), err
    assert expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["search.py"]  # nothing written


# ------------------------------------------------------------------ resumes and results


@unit
def test_a_resumed_study_keeps_its_directions(tmp_path: Path) -> None:
    from clusterkit.runners.hpo import inputs

    url = f"sqlite:///{tmp_path}/s.db"  # each open, a storage of its own
    study = inputs.open_study(None, url, "s", None, None, None, directions=["minimize"] * 2)
    assert [d.name for d in study.directions] == ["MINIMIZE", "MINIMIZE"]
    again = inputs.open_study(None, url, "s", None, None, None, ["minimize", "minimize"])
    assert again._study_id == study._study_id
    assert inputs.open_study(None, url, "s", None, None, None).directions == study.directions
    with pytest.raises(BadInput) as refused:
        inputs.open_study(None, url, "s", "maximize", None, None)
    assert refused.value.one_line() == (
        "study 's' exists with directions minimize minimize, not maximize as given: a resumed "
        "study keeps its directions (give its own, or name another study)"
    )
    with pytest.raises(BadInput, match="not both"):
        inputs.open_study(None, url, "t", "maximize", None, None, directions=["maximize"])


def _front_study(n: int) -> optuna.Study:
    """``n`` trials, every one on the Pareto front."""
    study = optuna.create_study(directions=["minimize", "maximize"])
    for x in range(n):
        study.enqueue_trial({"x": float(x)})
    study.optimize(lambda t: (t.suggest_float("x", 0, 10),) * 2, n_trials=n)
    return study


@unit
def test_the_json_of_several_objectives_carries_the_whole_pareto_front() -> None:
    from clusterkit.runners.hpo import report

    document = report.summary(_front_study(7))
    assert document["directions"] == ["minimize", "maximize"] and document["best"] is None
    front = document["best_trials"]
    assert [t["number"] for t in front] == list(range(7))  # all of it, not the top 5
    assert front[3]["values"] == [3.0, 3.0] and front[3]["params"] == {"x": 3.0}
    single = optuna.create_study(direction="maximize")
    single.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    one = report.summary(single)
    assert one["best"]["number"] == single.best_trial.number
    assert one["best"]["value"] == single.best_value


@unit
def test_the_report_of_several_objectives_draws_the_pareto_front(tmp_path: Path) -> None:
    from clusterkit.runners.hpo import report

    report.write_results(_front_study(4), tmp_path / "two")
    page = (tmp_path / "two" / "report.html").read_text()
    assert (tmp_path / "two" / "pareto_front.png").is_file()
    assert "<h2>Pareto front</h2>" in page and "the Pareto front: 4 trials (#0, #1, #2, #3)" in page
    four = optuna.create_study(directions=["minimize"] * 4)
    four.optimize(lambda t: (t.suggest_float("x", 0, 1),) * 4, n_trials=3)
    report.write_results(four, tmp_path / "four")  # no plot of one target: none, no error
    assert (tmp_path / "four" / "report.html").is_file()
    assert not list((tmp_path / "four").glob("*.png"))


# ------------------------------------------------------------------ the command on a cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from tests.clusters import local_client

    with local_client(2) as connected:
        yield connected


@pytest.fixture
def client(cluster: Any) -> Iterator[Any]:
    from tests.clusters import as_new

    with as_new(cluster) as connected:
        yield connected


def _cli(client: Any, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``clusterkit hpo ARGS`` in a new process, attached to ``client``'s cluster."""
    environ = {**os.environ, "CLUSTERKIT_SCHEDULER": client.scheduler.address}
    command = [sys.executable, "-m", "clusterkit", "hpo", *args, "--no-progress"]
    return subprocess.run(
        command, env=environ, cwd=cwd, capture_output=True, text=True, timeout=180
    )


@local
def test_a_search_of_two_objectives_shows_its_pareto_front(client: Any, tmp_path: Path) -> None:
    (tmp_path / "obj.py").write_text(textwrap.dedent(TWO_OBJECTIVES))
    both = ("--directions", "minimize", "maximize")
    tpe = ("--sampler", "TPESampler", "--sampler-kwargs", '{"multivariate": true, "seed": 1}')
    median = ("--pruner", "MedianPruner", "--pruner-kwargs", '{"n_warmup_steps": 5}')
    done = _cli(client, tmp_path, "obj.py:objective", *both, *tpe, *median, "-n", "4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("best: the Pareto front (4): #0 values ["), done.stdout
    assert (tmp_path / "obj-objective-results" / "pareto_front.png").is_file()

    again = ("--directions=minimize", "maximize", "--json")
    done = _cli(client, tmp_path, "obj.py:objective", "-n", "6", *again)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    study = journal_study(tmp_path / "obj-objective.optuna.log", "obj-objective")
    assert [d.name for d in study.directions] == ["MINIMIZE", "MAXIMIZE"]
    assert document["directions"] == ["minimize", "maximize"] and document["best"] is None
    assert document["trials"]["complete"] == 6
    assert [t["number"] for t in document["best_trials"]] == list(range(6))
    for shown, trial in zip(document["best_trials"], study.trials, strict=True):
        assert shown["values"] == trial.values and shown["params"] == trial.params

    done = _cli(client, tmp_path, "obj.py:objective", "-n", "8", "--direction", "maximize")
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.splitlines() == [
        "error: study 'obj-objective' exists with directions minimize maximize, not maximize as "
        "given: a resumed study keeps its directions (give its own, or name another study)"
    ]


@local
def test_the_sampler_and_pruner_kwargs_take_effect(client: Any, tmp_path: Path) -> None:
    """A GridSampler runs exactly its grid; a ThresholdPruner prunes above its upper bound, on
    the driver's study (the workers' trials see it through the driver)."""
    (tmp_path / "obj.py").write_text(textwrap.dedent(REPORTING))
    grid = '{"search_space": {"x": [0.0, 0.25, 0.75, 1.0]}, "seed": 1}'
    done = _cli(
        client,
        tmp_path,
        "obj.py:objective",
        "-n",
        "4",
        *("--sampler", "GridSampler", "--sampler-kwargs", grid),
        *("--pruner", "ThresholdPruner", "--pruner-kwargs", '{"upper": 0.5}'),
    )
    assert done.returncode == 0, done.stderr
    trials = journal_study(tmp_path / "obj-objective.optuna.log", "obj-objective").trials
    assert sorted(t.params["x"] for t in trials) == [0.0, 0.25, 0.75, 1.0]
    states = {t.params["x"]: t.state.name for t in trials}
    assert states == {0.0: "COMPLETE", 0.25: "COMPLETE", 0.75: "PRUNED", 1.0: "PRUNED"}
