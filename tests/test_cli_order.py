"""Listings in an order users can predict, and the state files a command leaves behind."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from clusterkit import state
from clusterkit.cli import main
from clusterkit.runs.records import RunRecord
from clusterkit.state import ClusterRecord

pytestmark = pytest.mark.unit


def cli_out(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        main(argv)
    except SystemExit as exited:
        assert not exited.code, (argv, capsys.readouterr())
    return capsys.readouterr().out


def finished_run(run_id: str, started_at: float) -> RunRecord:
    record = RunRecord(
        id=run_id, kind=run_id.split("-")[0], argv=[], cwd="/", profile="local", cluster=None,
        results=None, state="succeeded", started_at=started_at, ended_at=started_at + 1,
    )  # fmt: skip
    record.save()
    return record


def test_runs_are_listed_as_they_started_newest_last(
    isolated_state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """IDs end in random hex and start with the kind: their order is not the runs' order."""
    now = time.time()
    started = ["train-1126-f0a1b2", "hpo-1126-ffffff", "hpo-1126-000000", "train-1126-0c0c0c"]
    for age, run_id in zip((400, 300, 200, 100), started, strict=True):
        finished_run(run_id, now - age)
    assert [row["id"] for row in json.loads(cli_out(["runs", "--json"], capsys))] == started
    table = cli_out(["runs"], capsys)
    assert sorted(started, key=table.index) == started


def test_clusters_are_listed_as_they_started_newest_last(
    isolated_state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `runs`: dead records (nothing to reach), names in another order than their starts."""
    now = time.time()
    names = ["zeta", "alpha", "mid"]
    for age, name in zip((300, 200, 100), names, strict=True):
        state.write_record(
            ClusterRecord(
                name=name, backend="local", profile="local", profile_source=None, digest="",
                address="tls://127.0.0.1:1", dashboard=None, pid=None, security={},
                min_workers=1, started_at=now - age, owner=2**22 + 1,  # no such process
            )
        )  # fmt: skip
    rows = json.loads(cli_out(["ls", "--json"], capsys))
    assert [row["name"] for row in rows] == names


def test_profiles_are_listed_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not by the directory each comes from, nor with `local-cuda.yaml` before `local.yaml`."""
    (tmp_path / "profiles").mkdir()
    for name in ("zeta", "alpha"):
        (tmp_path / "profiles" / f"{name}.yaml").write_text("backend: local\nworkers: 1\n")
    monkeypatch.chdir(tmp_path)
    names = [row["name"] for row in json.loads(cli_out(["profiles", "list", "--json"], capsys))]
    assert {"alpha", "zeta", "local", "local-cuda"} <= set(names)
    assert names == sorted(names)


def test_the_stop_request_is_private(
    isolated_state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0600 like every other file of the run's state (its folder is 0700)."""
    record = finished_run("hpo-1126-5a5a5a", time.time())
    record.state = "running"  # no monitor: stop records the end itself
    record.save()
    cli_out(["runs", "stop", record.id, "--timeout", "0"], capsys)
    stop = state.run_dir(record.id) / "stop"
    assert stop.stat().st_mode & 0o777 == 0o600
    assert state.run_dir(record.id).stat().st_mode & 0o777 == 0o700


def test_a_lock_file_goes_with_the_name_and_a_waiter_still_excludes(isolated_state: Path) -> None:
    """The holder unlinks the file once nothing of the cluster is left; whoever waited on the
    unlinked file locks the path's new one, and a third process is still shut out."""
    path = state.clusters_dir() / "gone.lock"
    waiter_holds = threading.Event()
    release_waiter = threading.Event()

    def waiter() -> None:
        with state.lock("gone") as held:
            assert held
            waiter_holds.set()
            release_waiter.wait(30)

    with state.lock("gone"):
        thread = threading.Thread(target=waiter)
        thread.start()
        while not path.exists():
            time.sleep(0.01)
        time.sleep(0.2)  # the waiter is blocked in flock on this file
    assert waiter_holds.wait(30)
    assert path.exists(), "the waiter holds a file no other process can find"
    with state.lock("gone", wait=False) as third:
        assert not third, "two holders at once"
    release_waiter.set()
    thread.join(30)
    assert not path.exists()


def test_a_lock_file_stays_while_its_cluster_is_recorded(isolated_state: Path) -> None:
    state.cluster_dir("kept")
    with state.lock("kept"):
        pass
    assert (state.clusters_dir() / "kept.lock").exists()
    state.remove_cluster("kept")  # what `down` and a supervisor's own close call
    assert not (state.clusters_dir() / "kept.lock").exists()
