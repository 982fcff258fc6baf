"""The project directory on workers: ignore rules, the size cap, in place vs synced, uploads
counted in bytes, late workers, checkpoints to storage; the example project end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterkit.errors import BadInput
from clusterkit.runners import ddp, workdir
from clusterkit.runners.ddp.script import run_file

distributed = pytest.importorskip("distributed")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ddp_project"


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache for synced copies (workers inherit the variable)."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("CLUSTERKIT_WORKDIR_CACHE", str(directory))
    return directory


@pytest.fixture
def client(cache: Path) -> Iterator[distributed.Client]:
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
    )
    client = distributed.Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def project_copy(tmp_path: Path) -> Path:
    target = tmp_path / "ddp_project"
    shutil.copytree(EXAMPLE, target, ignore=shutil.ignore_patterns("snapshot.pt", "__pycache__"))
    return target


def snapshot_runs(path: Path) -> list[int]:
    state = torch.load(path, weights_only=False)
    return [run["started_at"] for run in state["runs"]]


# ---------------------------------------------------------------- scanning (no processes)


@pytest.mark.unit
def test_scan_follows_ignore_rules(tmp_path: Path) -> None:
    root = tmp_path / "p"
    for relative in (
        "main.py",
        "pkg/util.py",
        "pkg/data/big.bin",
        "pkg/keep.txt",
        ".git/HEAD",
        "venv/lib/x.py",
        "__pycache__/main.cpython-311.pyc",
        "notes/draft.md",
        "out/result.csv",
    ):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(relative)
    (root / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (root / ".gitignore").write_text("out/\n")
    (root / "pkg" / ".gitignore").write_text("data/\n")
    (root / ".clusterkitignore").write_text("notes/\n")
    project = workdir.scan(root)
    assert [f.path for f in project.files] == [
        ".clusterkitignore",
        ".gitignore",
        "main.py",
        "pkg/.gitignore",
        "pkg/keep.txt",
        "pkg/util.py",
    ]
    again = workdir.scan(root)
    assert again.digest == project.digest and again.key == project.key
    (root / "main.py").write_text("changed")
    assert workdir.scan(root).digest != project.digest


@pytest.mark.unit
def test_scan_never_ships_a_state_directory_inside_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records, logs and a cluster's private keys stay where they are."""
    root = tmp_path / "p"
    (root / "state" / "clusters" / "c").mkdir(parents=True)
    (root / "state" / "clusters" / "c" / "key.pem").write_text("secret")
    (root / "main.py").write_text("")
    (root / "state.py").write_text("")
    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(root / "state"))
    assert [f.path for f in workdir.scan(root).files] == ["main.py", "state.py"]


@pytest.mark.unit
def test_over_the_cap_names_the_largest_files(tmp_path: Path) -> None:
    (tmp_path / "small.py").write_text("x = 1\n")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 5000)
    with pytest.raises(BadInput) as info:
        workdir.scan(tmp_path, max_size=4096)
    text = info.value.one_line()
    assert "over the 4.00 kiB cap" in text and "weights.bin (4.88 kiB)" in text
    assert "\n" not in text


@pytest.mark.local
@pytest.mark.parametrize(
    "command", [["train", "train.py"], ["hpo", "obj.py:objective", "--trials", "1"]]
)
def test_cli_over_the_cap_is_one_line_exit_2_before_anything_starts(
    tmp_path: Path, command: list[str]
) -> None:
    project = project_copy(tmp_path)
    (project / "obj.py").write_text("def objective(trial):\n    return 1.0\n")
    (project / "big.bin").write_bytes(b"\0" * 8192)
    done = subprocess.run(
        [sys.executable, "-m", "clusterkit", *command, "--workdir-max-size", "4KiB"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "big.bin" in lines[0]
    assert "Traceback" not in done.stderr and "--workdir-max-size" in lines[0]


# ---------------------------------------------------------------- shipping


@pytest.mark.local
def test_unchanged_rerun_uploads_nothing(client, tmp_path: Path, cache: Path) -> None:
    root = project_copy(tmp_path)
    project = workdir.scan(root, copy=True)
    first = workdir.ship(client, project)
    assert set(first.modes.values()) == {"synced"}
    # two workers share one cache directory: the project went up once
    assert first.bytes_sent == project.size
    assert workdir.ship(client, workdir.scan(root, copy=True)).bytes_sent == 0
    (root / "model.py").write_text((root / "model.py").read_text() + "\n# edited\n")
    edited = workdir.ship(client, workdir.scan(root, copy=True))
    assert edited.bytes_sent == (root / "model.py").stat().st_size
    copies = list((cache / "projects").glob("ddp_project-*/model.py"))
    assert len(copies) == 1 and copies[0].read_text().endswith("# edited\n")
    # on a shared disk the same project runs in place and nothing is sent
    in_place = workdir.ship(client, workdir.scan(root, copy=False))
    assert set(in_place.modes.values()) == {"in-place"} and in_place.bytes_sent == 0


def read_sibling() -> tuple[str, str]:
    import model  # a module of the project, found through sys.path[0]

    return os.getcwd(), model.__file__


@pytest.mark.local
def test_late_worker_gets_the_project(
    client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = project_copy(tmp_path)
    project = workdir.scan(root, copy=True)
    workdir.ship(client, project)
    before = set(client.scheduler_info()["workers"])
    late_cache = tmp_path / "late-cache"  # a disk of its own: nothing there yet
    monkeypatch.setenv("CLUSTERKIT_WORKDIR_CACHE", str(late_cache))
    client.cluster.scale(3)
    client.wait_for_workers(3, timeout=60)
    (late,) = set(client.scheduler_info()["workers"]) - before

    def run_inside(project: workdir.Project) -> tuple[str, str]:
        with workdir.entered(project):
            return read_sibling()

    cwd, module_file = client.submit(run_inside, project, workers=[late], pure=False).result(60)
    assert cwd.startswith(str(late_cache)) and module_file == os.path.join(cwd, "model.py")
    assert (Path(cwd) / "config.json").read_bytes() == (root / "config.json").read_bytes()


# ---------------------------------------------------------------- the example, end to end


@pytest.mark.local
def test_example_project_in_place_resumes_from_its_snapshot(client, tmp_path: Path) -> None:
    root = project_copy(tmp_path)
    assert run_file(str(root / "train.py"), ["1", "1"], client=client) == [None, None]
    assert run_file(str(root / "train.py"), ["2", "1"], client=client) == [None, None]
    # the snapshot landed in the user's own directory, and the rerun resumed from epoch 1
    assert snapshot_runs(root / "snapshot.pt") == [0, 1]


@pytest.mark.local
def test_example_project_synced_resumes_from_checkpoint_dir(
    client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    monkeypatch.setenv(workdir.COPY_ENV, "1")  # as if the workers had a disk of their own
    root = project_copy(tmp_path)
    storage = tmp_path / "storage"
    for epochs in ("1", "2"):
        results = run_file(
            str(root / "train.py"), [epochs, "1"], client=client, checkpoint_dir=str(storage)
        )
        assert results == [None, None]
    assert snapshot_runs(storage / "snapshot.pt") == [0, 1]
    assert not (root / "snapshot.pt").exists()  # ranks ran in the synced copy


def save_too_much(ctx) -> None:
    ctx.save_checkpoint({"weights": torch.zeros(17 * 2**20)})  # 68 MiB


@pytest.mark.local
def test_large_checkpoint_without_storage_names_checkpoint_dir(client, tmp_path: Path) -> None:
    with pytest.raises(ddp.TrainingFailed, match="checkpoint_dir"):
        ddp.run(save_too_much, client=client, world_size=1, workdir=None)
    # with storage the same state is saved, and a later run loads it
    ddp.run(save_too_much, client=client, world_size=1, workdir=None, checkpoint_dir=str(tmp_path))
    assert (tmp_path / "checkpoint.pt").stat().st_size > 64 * 2**20


# ---------------------------------------------------------------- HPO


OBJECTIVE = """
import os
import warnings
from pathlib import Path

from shapes import toy_data

OFFSET = float(Path(__file__).with_name("offset.txt").read_text())


def objective(trial):
    x = trial.suggest_float("x", -3, 3)
    trial.set_user_attr("cwd", os.getcwd())
    warnings.warn("toy data is tiny")
    return float(sum((x - v) ** 2 for v in toy_data())) + OFFSET
"""


@pytest.mark.local
def test_hpo_objective_imports_a_sibling_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, cache: Path
) -> None:
    optuna = pytest.importorskip("optuna")
    from clusterkit.cli import main

    project = tmp_path / "search"
    project.mkdir()
    (project / "obj.py").write_text(OBJECTIVE)
    (project / "shapes.py").write_text("def toy_data():\n    return [1.0, 2.0]\n")
    (project / "offset.txt").write_text("10\n")
    monkeypatch.chdir(tmp_path)  # not the project: the default workdir is the file's directory
    monkeypatch.setenv(workdir.COPY_ENV, "1")  # trials run in the synced copy
    with pytest.warns(UserWarning) as raised:
        main(["hpo", "search/obj.py:objective", "--trials", "3", "--no-progress", "-p", "local"])
    tiny = [str(w.message) for w in raised if "toy data" in str(w.message)]
    assert tiny == ["toy data is tiny (raised in 3 trials)"]  # once, counted
    study = optuna.load_study(
        study_name="obj-objective",
        storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(tmp_path / "obj-objective.optuna.log"))
        ),
    )
    trials = study.get_trials(states=[optuna.trial.TrialState.COMPLETE])
    assert len(trials) == 3 and all(t.value >= 10.5 for t in trials)
    assert {Path(t.user_attrs["cwd"]).parent for t in trials} == {cache / "projects"}
    assert "best: trial #" in capsys.readouterr().out  # stdout carries the data


def warn_in_every_rank(ctx) -> int:
    import warnings

    warnings.warn("the same in every rank", RuntimeWarning, stacklevel=1)
    return ctx.rank


@pytest.mark.local
def test_a_warning_in_every_rank_is_shown_once_with_a_count(client) -> None:
    with pytest.warns(RuntimeWarning) as raised:
        # not streamed: each once, counted (streamed: each rank's line as it happens)
        ranks = ddp.run(warn_in_every_rank, client=client, workdir=None, stream_output=False)
    assert ranks == [0, 1]
    shown = [str(w.message) for w in raised if "every rank" in str(w.message)]
    assert shown == ["the same in every rank (raised in 2 ranks)"]


# ---------------------------------------------------------------- every backend (helper)


def example_project_on(client, tmp_path: Path, *, copy: bool) -> set[str]:
    """The example project and a sibling-importing objective, unchanged, on ``client``'s
    cluster; returns the workers' modes ("in-place" / "synced").

    Without a shared disk (``copy``) the second run resumes from ``checkpoint_dir``; in place
    it resumes from the snapshot in the user's own directory.
    """
    import optuna

    from clusterkit.runners import hpo
    from clusterkit.runners.hpo import inputs

    root = project_copy(tmp_path)
    (root / "obj.py").write_text(OBJECTIVE)
    (root / "shapes.py").write_text("def toy_data():\n    return [1.0, 2.0]\n")
    (root / "offset.txt").write_text("10\n")
    project = workdir.scan(root, copy=copy)
    modes = set(workdir.ship(client, project).modes.values())
    storage = str(tmp_path / "storage") if copy else None
    for epochs in ("1", "2"):
        assert set(
            run_file(
                str(root / "train.py"),
                [epochs, "1"],
                client=client,
                workdir=project,
                checkpoint_dir=storage,
                timeout=180,
            )
        ) == {None}
    snapshot = Path(storage) / "snapshot.pt" if storage else root / "snapshot.pt"
    assert snapshot_runs(snapshot) == [0, 1]
    assert workdir.ship(client, workdir.scan(root, copy=copy)).bytes_sent == 0
    sys.path.insert(0, str(root))
    try:
        objective = inputs.load_objective(f"{root}/obj.py:objective")
    finally:
        sys.path.remove(str(root))
    study = hpo.run(
        objective,
        n_trials=2,
        client=client,
        workdir=project,
        progress=False,
        storage=optuna.storages.InMemoryStorage(),
    )
    trials = study.get_trials(states=[optuna.trial.TrialState.COMPLETE])
    assert len(trials) == 2 and all(t.value >= 10 for t in trials)
    assert all((t.user_attrs["cwd"] == str(root)) != copy for t in trials)
    return modes


def edit_then_die(ctx) -> str:
    """Attempt 0: rank 1 edits a project file in place, then its worker dies."""
    import signal
    import time

    if ctx.restart_count == 0 and ctx.rank == 1:
        Path("version.txt").write_text("edited during the run\n")
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(30)
    if ctx.restart_count == 0:
        time.sleep(30)  # rank 0 waits to be stopped with the group
    return Path("version.txt").read_text().strip()


@pytest.mark.local
def test_restart_after_the_project_changed_on_disk(client, tmp_path: Path) -> None:
    """The replacement worker finds the project as it is now (a restart re-reads it, as
    torchrun's would), instead of failing on digests that no longer match."""
    root = tmp_path / "edited"
    root.mkdir()
    (root / "version.txt").write_text("original\n")
    results = ddp.run(edit_then_die, client=client, workdir=root, max_restarts=1, timeout=150)
    assert results == ["edited during the run"] * 2


def venv_objective(trial) -> float:  # type: ignore[no-untyped-def]
    """Imports a module of the project and one of a virtual environment inside the project."""
    site = os.path.join(os.getcwd(), ".venv", "lib", "site-packages")
    if site not in sys.path:
        sys.path.append(site)
    import own  # type: ignore[import-not-found]
    import venvmod  # type: ignore[import-not-found]

    venvmod.RUNS = getattr(venvmod, "RUNS", 0) + 1  # kept only while the module is
    trial.set_user_attr("runs", venvmod.RUNS)
    return float(own.VALUE)


@pytest.mark.local
def test_an_edited_project_reloads_its_own_modules_not_its_venv(cache: Path,
                                                                tmp_path: Path) -> None:
    """A project with its virtual environment inside (``python -m venv .venv``), edited
    between two searches on a long-lived worker: the project's module is imported anew, the
    venv's modules are left alone (forgetting numpy or psutil there broke the worker)."""
    import optuna

    from clusterkit.runners import hpo

    root = tmp_path / "project"
    site = root / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (site / "venvmod.py").write_text("RUNS = 0\n")
    (root / "own.py").write_text("VALUE = 1\n")
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, host="127.0.0.1",
                                 dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        runs = []
        for value in (1, 2):
            (root / "own.py").write_text(f"VALUE = {value}\n")
            study = hpo.run(venv_objective, n_trials=1, client=client, workdir=root,
                            storage=optuna.storages.InMemoryStorage(), progress=False)
            [trial] = study.trials
            assert trial.value == value, "the edited module was not imported anew"
            runs.append(trial.user_attrs["runs"])
    assert runs == [1, 2], "the venv's module was forgotten and imported again"
