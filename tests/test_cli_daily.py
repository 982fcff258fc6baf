"""The everyday loop around a running cluster, through the CLI as users run it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterkit import api, state

pytestmark = pytest.mark.local

CLI = [sys.executable, "-m", "clusterkit"]


def ck(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}  # tables unwrapped, as on a wide terminal
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def daily(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "daily.yaml"
    path.write_text("backend: local\nworkers: 1\nworker: {threads: 2}\n")
    started = ck("up", str(path))
    assert started.returncode == 0, started.stderr
    try:
        yield "daily"
    finally:
        if state.read_record("daily") is not None:
            api.down("daily")


def test_status_shows_load_mode_and_refreshes_with_watch(daily: str) -> None:
    info = json.loads(ck("status", daily, "--json").stdout)
    assert info["mode"] == "fixed" and info["gpus"] == 0
    worker = info["workers"][0]
    assert {"cpu", "memory", "gpu_utilization", "running", "queued"} <= set(worker)
    watched = ck("status", daily, "--watch", "--count", "2", "--interval", "0.2")
    assert watched.returncode == 0, watched.stderr
    assert "daily (local) at tls://127.0.0.1:" in watched.stdout
    for column in ("CPU", "GPU use", "running", "queued"):
        assert column in watched.stdout


def test_adapt_on_and_off_and_scale_says_it_ended_adaptive(daily: str) -> None:
    adapted = ck("adapt", daily, "--min", "1", "--max", "3")
    assert adapted.returncode == 0, adapted.stderr
    assert json.loads(ck("status", daily, "--json").stdout)["mode"] == "adaptive 1..3"
    scaled = ck("scale", daily, "2")
    assert scaled.returncode == 0 and "adaptive scaling ended" in scaled.stderr
    assert json.loads(ck("status", daily, "--json").stdout)["mode"] == "fixed"
    assert ck("adapt", daily, "--min", "1").returncode == 0
    off = ck("adapt", daily, "--off")
    assert off.returncode == 0 and "adaptive scaling ended" in off.stderr
    assert ck("adapt", daily).returncode == 2  # neither bounds nor --off


def test_logs_by_component_since_and_follow(daily: str) -> None:
    from clusterkit.client import get_client

    only = ck("logs", daily, "--component", "scheduler")
    assert only.returncode == 0 and "==> scheduler <==" in only.stdout
    assert "==> worker" not in only.stdout and "==> supervisor" not in only.stdout
    assert "==> worker" in ck("logs", daily, "-c", "worker").stdout
    bad = ck("logs", daily, "-c", "nonsense")
    assert bad.returncode == 2 and bad.stderr.startswith("error: no log component")
    follower = subprocess.Popen(
        [*CLI, "logs", daily, "-f", "-c", "worker"], stdout=subprocess.PIPE, text=True
    )
    assert follower.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(follower.stdout.readline, "")), daemon=True
    )
    reader.start()
    try:
        time.sleep(3)
        with get_client(daily) as client:
            client.submit(_log_marker, "clusterkit-follow-marker").result(timeout=30)
        deadline = time.monotonic() + 30
        while not any("clusterkit-follow-marker" in line for line in lines):
            assert time.monotonic() < deadline, "logs -f did not show the new line"
            time.sleep(0.2)
    finally:
        follower.terminate()
        follower.wait(timeout=30)
    assert "clusterkit-follow-marker" in ck("logs", daily, "-c", "worker", "--since", "10m").stdout
    time.sleep(3)
    assert "clusterkit-follow-marker" not in ck("logs", daily, "--since", "1s").stdout
    assert ck("logs", daily, "--since", "soon").returncode == 2


def _log_marker(text: str) -> None:
    import logging

    logging.getLogger("distributed.worker").warning(text)


def test_down_all_asks_on_a_terminal(daily: str) -> None:
    import pty

    leader, follower = pty.openpty()
    try:  # the prompt needs a terminal on stdin
        process = subprocess.Popen(
            [*CLI, "down", "--all"],
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.write(leader, b"n\n")
        _, err = process.communicate(timeout=60)
        assert process.returncode == 1, err
        assert state.read_record(daily) is not None, "answering no must stop nothing"
    finally:
        os.close(leader)
        os.close(follower)
    done = ck("down", "--all", "--yes")
    assert done.returncode == 0 and f"down {daily}" in done.stderr


def test_completion_of_profile_and_cluster_names(daily: str) -> None:
    def complete(words: str) -> list[str]:
        env = {
            **os.environ,
            "_CLUSTERKIT_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
        }
        done = subprocess.run(
            [sys.executable, "-c", "from clusterkit.cli import main; main()"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        return done.stdout.split()

    assert daily in complete("clusterkit status ")
    assert {"local", "local-cuda", "lab-scheduler"} <= set(complete("clusterkit up l"))
    assert complete("clusterkit down da") == [daily]


def test_doctor_table_keeps_brackets() -> None:
    done = ck("doctor", "slurm-gpu")
    assert "extra [jobqueue]" in done.stdout


def test_doctor_is_quiet_while_a_cluster_has_port_8787() -> None:
    """The check's scheduler serves HTTP on a free port: no distributed warning about 8787."""
    import socket

    taken = socket.socket()
    try:
        with contextlib.suppress(OSError):  # taken by someone else already: as good
            taken.bind(("127.0.0.1", 8787))
            taken.listen()
        done = ck("doctor")
    finally:
        taken.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker -> scheduler connection" in done.stdout
    assert "8787" not in done.stderr and "Warning" not in done.stderr, done.stderr


def test_down_leaves_nothing_of_the_cluster_behind(daily: str) -> None:
    """Record, folder and lock file: the name is free and nothing of it is left."""
    assert ck("down", daily).returncode == 0
    assert list(state.clusters_dir().iterdir()) == []


def test_status_lists_workers_in_name_order(tmp_path: Path) -> None:
    """Worker 2 before worker 10, not in the order of their random ports."""
    path = tmp_path / "many.yaml"
    path.write_text("backend: local\nworkers: 11\nprocesses: false\nworker: {threads: 1}\n")
    assert ck("up", str(path)).returncode == 0
    try:
        info = json.loads(ck("status", "many", "--json").stdout)
        table = ck("status", "many").stdout
    finally:
        api.down("many")
    names = [str(number) for number in range(11)]
    assert [worker["name"] for worker in info["workers"]] == names
    rows = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]
    assert rows == names


@pytest.mark.cuda_extra  # dask-cuda renders the CUDA profile: the compat tier has no cuda extra
def test_render_honours_threads_and_every_dask_cuda_option(tmp_path: Path) -> None:
    profile = tmp_path / "gpu.yaml"
    profile.write_text(
        "backend: slurm\ncores: 8\nmemory: 16GiB\nprocesses: 2\nworker: {gpus: 1, threads: 1}\n"
        "cuda: {rmm_maximum_pool_size: 40GB, pre_import: [cudf, torch]}\n"
    )
    done = ck("profiles", "render", str(profile))
    assert done.returncode == 0, done.stderr
    worker = done.stdout.strip().splitlines()[-1]
    assert worker.split().index("--nthreads") < len(worker.split()) - 1
    assert worker.rsplit("--nthreads", 1)[1].split()[0] == "1"  # the last --nthreads wins
    assert "--rmm-maximum-pool-size 40GB --pre-import cudf,torch" in worker
    local = tmp_path / "lc.yaml"
    local.write_text("backend: local-cuda\ncuda:\n  rmm_maximum_pool_sise: 40GB\n")
    done = ck("profiles", "render", str(local))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "did you mean 'rmm_maximum_pool_size'?" in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.unit
def test_gpu_columns_read_the_metrics_as_distributed_reports_them() -> None:
    """A dask-cuda worker's metrics as the scheduler reported them on an H200 (flattened names),
    and as older releases nest them: both give `status` its GPU use and memory columns."""
    from clusterkit.monitor import worker_row

    flat = {
        "nthreads": 1,
        "resources": {"GPU": 1},
        "metrics": {
            "cpu": 2.0,
            "gpu_utilization": 37,
            "gpu_memory_used": 1197342720,
            "gpu-memory-total": 150754820096,
            "task_counts": {"executing": 1},
        },
    }
    nested = {
        "nthreads": 1,
        "resources": {"GPU": 1},
        "metrics": {"gpu": {"utilization": 37, "memory-used": 1197342720}},
        "gpu": {"memory-total": 150754820096},
    }
    for worker in (flat, nested):
        row = worker_row("tls://127.0.0.1:1", worker, 1)
        assert (row["gpus"], row["gpu_utilization"]) == (1, 37)
        assert (row["gpu_memory_used"], row["gpu_memory_total"]) == (1197342720, 150754820096)
