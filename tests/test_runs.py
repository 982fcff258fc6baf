"""Detached runs on real local clusters: hangups, killed drivers, stop, down, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from clusterkit import api, runs, state
from clusterkit.runners.hpo.inputs import ATTR_ORPHANED, counted
from clusterkit.runs.records import RunRecord
from clusterkit.runs.status import shown_state

pytestmark = pytest.mark.local

OBJECTIVE = """
import time

def objective(trial):
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.3)
    return x * x
"""


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One cluster from `up` for the module (its own state directory), and its project."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CLUSTERKIT_STATE_DIR", str(root / "state"))
        # a spare rank process per worker would outlive the training test (the cluster's own)
        patch.setenv("CLUSTERKIT_DDP_SPARES", "0")
        profile = root / "lab.yaml"
        profile.write_text("backend: local\nworkers: 2\nworker:\n  threads: 1\n")
        (root / "search.py").write_text(textwrap.dedent(OBJECTIVE))
        record = api.up(profile, name="lab")
        try:
            yield record.name, root
        finally:
            with contextlib.suppress(Exception):
                api.down("lab")


@pytest.fixture
def in_lab(lab: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """The module's cluster and state directory, the project as the working directory."""
    name, root = lab
    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(root / "state"))
    monkeypatch.chdir(root)
    return name, root


def _study(root: Path, name: str) -> optuna.Study:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(root / f"{name}.optuna.log")))
    return optuna.load_study(study_name=name, storage=storage)


def _until(what: str, check: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _cli(*args: str) -> int:
    """``clusterkit ARGS`` in this process; its exit status."""
    from clusterkit.cli import main

    try:
        main(list(args))
    except SystemExit as exited:
        return exited.code if isinstance(exited.code, int) else 1
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _done(run_id: str) -> int:
    shown = runs.show(run_id)["progress"] or "0/0"
    return int(shown.split("/")[0])


def test_detached_search_survives_sighup_of_its_process_group_and_finishes(
    in_lab: tuple[str, Path],
) -> None:
    name, root = in_lab
    command = (
        f"{sys.executable} -m clusterkit hpo search.py:objective --trials 10 "
        f"--study-name hup -p {name} --detach > id.txt; sleep 60"
    )
    # a terminal's job: its own session and process group, hung up once the ID is printed
    shell = subprocess.Popen(["bash", "-c", command], start_new_session=True)
    try:
        _until("the run ID", lambda: _read(root / "id.txt").endswith("\n"), 30)
        printed = (root / "id.txt").read_text()
        run_id = printed.strip()
        assert printed == f"{run_id}\n" and run_id.startswith("hpo-")  # the ID alone
        os.killpg(shell.pid, signal.SIGHUP)
        assert shell.wait(10) == -signal.SIGHUP
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    _until("the monitor's record", lambda: runs.show(run_id)["monitor_pid"] is not None, 10)
    record = runs.show(run_id)
    assert record["target"] == f"cluster {name}" and record["host"] == state.HOST
    with contextlib.suppress(ProcessLookupError):  # (unless it finished already)
        assert os.getsid(record["monitor_pid"]) not in (os.getsid(0), shell.pid)
    assert runs.wait(run_id, timeout=90) == 0
    study = _study(root, "hup")
    assert sum(counted(t) for t in study.get_trials()) == 10
    info = runs.show(run_id)
    assert info["state"] == "succeeded" and info["progress"] == "10/10" and info["restarts"] == 0
    assert (Path(info["results"]) / "trials.csv").is_file()
    assert state.run_record_path(run_id).stat().st_mode & 0o777 == 0o600
    assert state.runs_dir().stat().st_mode & 0o777 == 0o700
    for private in state.run_dir(run_id).iterdir():  # driver log, progress: owner-only
        assert private.stat().st_mode & 0o777 == 0o600, private
    log = "".join(runs.logs(run_id))
    assert "[progress] trials 10/10" in log and "run succeeded" in log


def test_killed_driver_is_restarted_and_the_study_holds_each_trial_once(
    in_lab: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from clusterkit.lifecycle import spawn

    name, root = in_lab
    monkeypatch.setattr(spawn, "can_fork", lambda: False)  # the fresh-interpreter monitor
    run_id = runs.launch(
        "hpo",
        ["search.py:objective", "-n", "16", "--study-name", "kill", "-p", name, "--lookahead", "2"],
    )
    _until("four finished trials", lambda: _done(run_id) >= 4)
    first = runs.show(run_id)["driver_pid"]
    os.kill(first, signal.SIGKILL)
    assert runs.wait(run_id, timeout=90) == 0
    info = runs.show(run_id)
    assert info["state"] == "succeeded" and info["restarts"] == 1
    assert info["driver_pid"] != first
    assert info["restart_reasons"] == [f"driver pid {first} killed by SIGKILL"]
    listed = {row["id"]: row for row in runs.list_runs()}[run_id]
    assert listed["restarts"] == 1 and listed["progress"] == "16/16"
    trials = _study(root, "kill").get_trials()
    kept = [t for t in trials if counted(t)]
    assert len(kept) == 16 and all(t.state.name == "COMPLETE" for t in kept)
    assert len({t.number for t in kept}) == 16
    # what the killed driver had in flight is failed as an orphan, never counted
    assert all(t.state.name == "FAIL" for t in trials if t.user_attrs.get(ATTR_ORPHANED))
    assert len(trials) == 16 + sum(bool(t.user_attrs.get(ATTR_ORPHANED)) for t in trials)
    assert "driver killed by SIGKILL: restart 1" in "".join(runs.logs(run_id))


TRAIN = """
import time

def train(ctx, epochs):
    state = ctx.load_checkpoint() or {"epoch": 0}
    for epoch in range(state["epoch"], int(epochs)):
        time.sleep(0.5)
        if ctx.rank == 0:
            ctx.save_checkpoint({"epoch": epoch + 1})
    return state["epoch"]
"""


def test_killed_training_driver_resumes_from_its_last_checkpoint(
    in_lab: tuple[str, Path],
) -> None:
    import re

    name, root = in_lab
    (root / "train.py").write_text(textwrap.dedent(TRAIN))
    run_id = runs.launch("train", ["train.py:train", "-p", name, "--", "8"])
    checkpoint = Path(runs.show(run_id)["results"]) / "checkpoint.pt"
    _until("the first checkpoint", checkpoint.exists)
    os.kill(runs.show(run_id)["driver_pid"], signal.SIGKILL)
    assert runs.wait(run_id, timeout=90) == 0
    info = runs.show(run_id)
    assert info["state"] == "succeeded" and info["restarts"] == 1
    log = "".join(runs.logs(run_id))
    resumed_at = [int(n) for n in re.findall(r"│ \d+\s+│ (\d+)\s+│", log)]
    assert len(resumed_at) == 2 and min(resumed_at) >= 1, log  # not from epoch 0


def test_runs_stop_keeps_finished_trials_and_leaves_the_cluster_up(
    in_lab: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    name, root = in_lab
    run_id = runs.launch(
        "hpo", ["search.py:objective", "-n", "500", "--study-name", "stop", "-p", name]
    )
    _until("three finished trials", lambda: _done(run_id) >= 3)
    assert _cli("runs", "stop", run_id) == 0
    assert f"{run_id}: stopped" in capsys.readouterr().err
    info = runs.show(run_id)
    assert info["state"] == "stopped" and not state.pid_alive(info["driver_pid"])
    assert runs.wait(run_id) == 130
    finished = [t for t in _study(root, "stop").get_trials() if counted(t)]
    assert 3 <= len(finished) < 500
    assert info["progress"] == f"{len(finished)}/500"  # the last word of the stopped driver
    assert api.get_record(name) is not None and api.status(name)["workers"]


def test_a_run_whose_cluster_died_is_shown_so_and_still_stops(
    in_lab: tuple[str, Path],
) -> None:
    from clusterkit.lifecycle.spawn import kill_group

    _, root = in_lab
    record = api.up(root / "lab.yaml", name="brief")
    run_id = runs.launch(
        "hpo", ["search.py:objective", "-n", "500", "--study-name", "brief", "-p", "brief"]
    )
    _until("a finished trial", lambda: _done(run_id) >= 1)
    assert record.pid is not None
    kill_group(record.pid, grace=0)  # the supervisor and its workers, without a word
    gone = "cluster gone: 'brief' is no longer up"
    _until("the run to show its cluster gone", lambda: runs.show(run_id)["state"] == gone, 10)
    assert {row["id"]: row for row in runs.list_runs()}[run_id]["state"] == gone
    stopped = runs.stop(run_id, timeout=2)  # its client cannot close politely: killed after 2 s
    assert stopped.state == "stopped" and not state.pid_alive(stopped.driver_pid)
    api.down("brief")  # reaps the dead record


def test_a_killed_monitor_is_resumed_by_the_cluster_supervisor(
    in_lab: tuple[str, Path],
) -> None:
    """The monitor SIGKILLed (as its death with a rebooted host would look): the cluster's
    supervisor ends what its driver still runs, starts the run again, counts a restart."""
    _, root = in_lab
    name = api.up(root / "lab.yaml", name="watched").name
    run_id = runs.launch(
        "hpo", ["search.py:objective", "-n", "16", "--study-name", "orphan", "-p", name]
    )
    _until("two finished trials", lambda: _done(run_id) >= 2)
    first = runs.show(run_id)
    os.kill(first["monitor_pid"], signal.SIGKILL)
    try:
        assert runs.wait(run_id, timeout=120) == 0
    finally:
        api.down(name)
    info = runs.show(run_id)
    assert info["restarts"] == 1 and info["monitor_pid"] != first["monitor_pid"]
    assert info["restart_reasons"] == [
        f"monitor pid {first['monitor_pid']} gone: resumed by the supervisor of cluster '{name}'"
    ]
    assert not state.pid_alive(first["driver_pid"])
    kept = [t for t in _study(root, "orphan").get_trials() if counted(t)]
    assert len(kept) == 16 and len({t.number for t in kept}) == 16


def test_runs_resume_starts_a_lost_run_again(
    in_lab: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A run on an embedded profile has no supervisor to resume it: `runs resume ID`."""
    from clusterkit.lifecycle.spawn import kill_group

    _, root = in_lab
    run_id = runs.launch(
        "hpo", ["search.py:objective", "-n", "12", "--study-name", "lost", "-p", "lab.yaml"]
    )
    _until("a finished trial", lambda: _done(run_id) >= 1)
    first = runs.show(run_id)
    assert _cli("runs", "resume", run_id) == 2  # still running: not lost
    assert "is not lost: running" in capsys.readouterr().err
    os.kill(first["monitor_pid"], signal.SIGKILL)
    kill_group(first["driver_pid"], grace=0)  # the host's reboot, as the run sees it
    _until("the run shown lost", lambda: runs.show(run_id)["state"].startswith("lost"), 10)
    assert _cli("runs", "resume", run_id) == 0
    assert runs.wait(run_id, timeout=120) == 0
    info = runs.show(run_id)
    assert info["restarts"] == 1 and info["restart_reasons"] == [
        "resumed by `clusterkit runs resume`"
    ]
    kept = [t for t in _study(root, "lost").get_trials() if counted(t)]
    assert len(kept) == 12 and len({t.number for t in kept}) == 12
    assert _cli("runs", "resume", run_id) == 2  # ended: nothing to resume


def test_a_run_whose_cluster_is_gone_says_so(tmp_path: Path) -> None:
    record = RunRecord(
        id="hpo-x",
        kind="hpo",
        argv=[],
        cwd=str(tmp_path),
        profile="ghost",
        cluster="ghost",
        results=None,
        state="running",
        monitor_pid=os.getpid(),
    )
    assert shown_state(record) == "cluster gone: 'ghost' is no longer up"
    record.monitor_pid = 2**22 + 1  # above pid_max's default: no such process
    assert shown_state(record).startswith("lost: its monitor")
    record.host = "elsewhere.example"
    assert shown_state(record) == "running on host elsewhere.example"


def test_unreadable_run_record_is_listed(tmp_path: Path) -> None:
    state.run_dir("hpo-torn")
    state.run_record_path("hpo-torn").write_text("{not json")
    (row,) = runs.list_runs()
    assert row["id"] == "hpo-torn" and row["state"].startswith("unreadable: ")
    assert str(state.run_record_path("hpo-torn")) == row["target"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["bad.py:objective", "-n", "2", "--detach"], "loading 'bad.py' failed: ZeroDivisionError"),
        (["search.py:nothing", "-n", "2", "--detach"], "has no function 'nothing'"),
        (["search.py:objective", "-n", "2", "--max-restarts", "-1", "--detach"], "--max-restarts"),
        (["search.py:objective", "-n", "2", "--lookahead", "-1", "--detach"], "--lookahead must"),
        (
            ["search.py:objective", "-n", "2", "-p", "no-such-profile", "--detach"],
            "no-such-profile",
        ),
        (
            ["search.py:objective", "-n", "4", "--batch"],
            "--batch needs --profile: a slurm or pbs profile",
        ),
        (
            ["search.py:objective", "-n", "4", "-p", "local", "--batch"],
            "one SLURM or PBS job; profile 'local' is local",
        ),
    ],
)
def test_detach_or_batch_with_bad_input_fails_before_a_run_id(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    (tmp_path / "search.py").write_text(textwrap.dedent(OBJECTIVE))
    (tmp_path / "bad.py").write_text("1 / 0\n")
    monkeypatch.chdir(tmp_path)
    assert _cli("hpo", *args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and err.startswith("error: ") and "\n" not in err, err
    assert expected in err
    assert not state.runs_dir().exists() or not state.run_ids()


@pytest.mark.parametrize("verb", ["logs", "wait", "stop", "show"])
def test_unknown_run_id_is_one_line_naming_the_known_ones(
    verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    known = RunRecord(
        id="hpo-known", kind="hpo", argv=[], cwd="/", profile="p", cluster=None, results=None
    )
    known.state = "succeeded"
    known.save()
    assert _cli("runs", verb, "hpo-nope") == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: no run 'hpo-nope' (known: hpo-known)", err


def test_runs_lists_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    record = RunRecord(
        id="train-1", kind="train", argv=[], cwd="/", profile="p", cluster=None, results="/r"
    )
    record.state, record.exit_code, record.reason = "failed", 1, "driver exited with 1"
    record.save()
    assert _cli("runs", "--json") == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["id"] == "train-1" and row["state"] == "failed (driver exited with 1)"
    assert row["target"] == "profile p" and row["restarts"] == 0


LAUNCH_A_SPEC = """
import sys
from clusterkit import runs

spec = runs.RunSpec.hpo("search.py:objective", trials=6, study_name="spec", profile=sys.argv[1])
print(runs.launch(spec))
assert "clusterkit.cli" not in sys.modules, "the CLI was imported"
"""


def test_a_spec_launched_from_python_runs_detached_without_the_cli(
    in_lab: tuple[str, Path],
) -> None:
    """``runs.launch(RunSpec)`` in a process that never imports the CLI: the search runs
    detached, `runs show` sees it, its record holds the spec with every path absolute."""
    from clusterkit.runs.records import get

    name, root = in_lab
    (root / "launch_spec.py").write_text(LAUNCH_A_SPEC)
    done = subprocess.run(
        [sys.executable, "launch_spec.py", name], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    assert runs.wait(run_id, timeout=90) == 0, "".join(runs.logs(run_id))
    info = runs.show(run_id)
    assert info["state"] == "succeeded" and info["progress"] == "6/6"
    assert info["target"] == f"cluster {name}" and info["results"] == str(root / "spec-results")
    assert info["command"] == (
        f"clusterkit hpo {root}/search.py:objective --trials 6 --study-name spec --direction "
        f"minimize --out {root}/spec-results --storage {root}/spec.optuna.log --profile {name}"
    )
    recorded = get(run_id).spec
    assert recorded is not None and recorded["target"] == f"{root}/search.py:objective"
    assert recorded["options"]["trials"] == 6 and recorded["cwd"] == str(root)
    assert (root / "spec-results" / "trials.csv").is_file()
    assert "best: " in "".join(runs.logs(run_id))


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: runs.RunSpec.hpo("search.py:objective", trials=0), "--trials must be at least 1"),
        (
            lambda: runs.RunSpec.hpo("search.py:objective", trials=2, direction="up"),
            "--direction must be minimize or maximize, got 'up'",
        ),
        (
            lambda: runs.RunSpec.hpo("search.py:objective", trials=2, lookahed=3),
            "run spec: options.lookahed: Extra inputs are not permitted, got 3",
        ),
        (
            lambda: runs.RunSpec.hpo("search.py:objective", trials="many"),
            "run spec: options.trials: Input should be a valid integer",
        ),
        (lambda: runs.RunSpec.train("t.py", world_size=0), "--world-size must be at least 1"),
        (
            lambda: runs.launch("hpo", ["search.py:objective", "-n", "2", "--max-resumes", "-1"]),
            "--max-resumes must be 0 or more, got -1",
        ),
        (
            lambda: runs.launch(runs.RunSpec.hpo("search.py:nothing", trials=2)),
            "has no function 'nothing'",
        ),
        (
            lambda: runs.launch(runs.RunSpec.hpo("search.py:objective", trials=2, profile="nope")),
            "nope",
        ),
        (
            lambda: runs.launch(runs.RunSpec.hpo("search.py:objective", trials=2), max_restarts=-1),
            "--max-restarts must be 0 or more, got -1",
        ),
        (lambda: runs.launch("hpo", ["search.py:objective", "-n", "x"]), "invalid int value"),
        (lambda: runs.launch("sweep", ["search.py:objective"]), "kind must be hpo or train"),
    ],
)
def test_a_bad_spec_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: object, expected: str
) -> None:
    from clusterkit.errors import BadInput

    (tmp_path / "search.py").write_text(textwrap.dedent(OBJECTIVE))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as refused:
        make()  # type: ignore[operator]
    line = refused.value.one_line()
    assert expected in line and "\n" not in line, line
    assert refused.value.exit_code == 2
    assert not state.runs_dir().exists() or not state.run_ids()


def test_a_spec_round_trips_through_its_record_and_its_command_line(tmp_path: Path) -> None:
    from clusterkit.runs import dashboard
    from clusterkit.runs.execution import recorded_spec
    from clusterkit.runs.records import get
    from clusterkit.runs.spec import command_line, from_command_line

    search = runs.RunSpec.hpo(
        "/p/search.py:objective",
        trials=40,
        study_name="s",
        storage="sqlite:////p/s.db",
        gpus_per_trial=0.5,
        trial_walltime=600,
        lookahead=0,
        max_retries=0,
        max_resumes=40,
        no_workdir=True,
        profile="/p/gpu.yaml",
    )
    training = runs.RunSpec.train(
        "/p/fit.py:train", world_size=4, max_restarts=2, script_args=["--epochs", "3", "--"]
    )
    for spec in (search, training):
        argv = command_line(spec)
        record = RunRecord(
            f"{spec.kind}-1", spec.kind, argv, spec.cwd, "p", None, None, spec=spec.model_dump()
        )
        record.save()
        assert recorded_spec(get(record.id)) == spec
        assert from_command_line(spec.kind, argv, cwd=spec.cwd)[0] == spec
        record.spec = None  # a record from before specs: its arguments, read as the CLI reads them
        record.save()
        assert recorded_spec(get(record.id)) == spec
    assert command_line(training)[-4:] == ["--", "--epochs", "3", "--"]
    study = dashboard.study_of("hpo-1")
    assert (study.storage, study.study_name) == ("sqlite:////p/s.db", "s")


def test_the_commands_and_the_spec_take_the_same_flags() -> None:
    """Every option of `clusterkit hpo|train` is a field of its spec's options, with the same
    flags (what `runs.launch(KIND, ARGS)` parses), or one that detaching takes beside."""
    import typer

    from clusterkit.cli import app
    from clusterkit.runs import spec as run_spec

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for kind, model in (("hpo", run_spec.HpoOptions), ("train", run_spec.TrainOptions)):
        restarts = run_spec.DETACH_FLAGS[kind].removeprefix("--").replace("-", "_")
        beside = {"target", "profile", "detach", "batch", restarts}
        if kind == "hpo":  # --direction: one objective's spelling of the field --directions
            beside.add("direction")
        flags = {
            param.name: (*param.opts, *param.secondary_opts)
            for param in commands[kind].params
            if param.name not in beside
        }
        fields = set(model.model_fields) - {"kind", "script_args"}
        assert set(flags) == fields, kind
        for name, given in flags.items():
            expected = run_spec.FLAGS.get(name, (f"--{name.replace('_', '-')}",))
            assert set(given) - {f"--no-{name}"} == set(expected), name


def test_a_spec_executed_in_this_process_shows_what_the_command_shows(
    in_lab: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``runs.execute(spec)``: the search `clusterkit hpo` runs attached, from the library."""
    name, root = in_lab
    spec = runs.RunSpec.hpo("search.py:objective", trials=3, study_name="here", profile=name)
    assert runs.execute(spec) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("best: trial #") and len(out) == 2
    assert out[1] == "results: here-results/ (report.html, trials.csv, *.png)"
    assert (root / "here-results" / "trials.csv").is_file()
    assert sum(counted(t) for t in _study(root, "here").get_trials()) == 3


def test_down_stops_the_runs_on_its_cluster_first(
    in_lab: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    name, _ = in_lab  # the module's last test that uses it: it takes the cluster down
    run_id = runs.launch(
        "hpo", ["search.py:objective", "-n", "500", "--study-name", "down", "-p", name]
    )
    _until("a finished trial", lambda: _done(run_id) >= 1)
    assert _cli("down", name) == 0
    err = capsys.readouterr().err
    assert f"stopped run(s) on cluster '{name}' first: {run_id}" in err
    assert err.index("stopped run(s)") < err.index(f"down {name}")
    assert runs.show(run_id)["state"] == "stopped"
