"""`clusterkit train`'s terminal, as a user sees it: the ranks' lines live and whole, prefixed
with the rank; warnings as they happen; one line per failed rank; Ctrl-C in one line.

Each test runs the real command in a subprocess against a cluster that is `up` (local; SLURM
in the slurm tier), or an embedded one where the terminal's Ctrl-C reaches every process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterkit import api

pytest.importorskip("torch")

LINES, WIDTH = 300, 400  # lines per rank, characters per line: well over a pipe's atomic write
TORCHRUN_VARS = ("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
TORCHRUN_VARS += ("TORCHELASTIC_MAX_RESTARTS", "LOCAL_RANK", "WORLD_SIZE")

CHATTY = f"""
import json, os, sys, time, warnings
from pathlib import Path
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
for i in range({LINES}):
    print(f"r{{rank}} line {{i}} " + "x" * {WIDTH})
if rank == 1:  # mid-run: the run goes on only once the test has seen the warning
    warnings.warn("rank one warns mid-run")
    marker = Path(sys.argv[1])
    for _ in range(1200):
        if marker.exists():
            break
        time.sleep(0.05)
    else:
        raise RuntimeError("the warning was not shown while the rank ran")
print("env " + json.dumps({{k: os.environ.get(k) for k in {TORCHRUN_VARS!r}}}))
dist.barrier()
dist.destroy_process_group()
"""

FAILING = """
import torch.distributed as dist

dist.init_process_group("gloo")
print("before the failure", flush=True)
if dist.get_rank() == 1:
    raise ValueError("rank one gives up")
"""

SLEEPY = """
import time
import torch.distributed as dist

dist.init_process_group("gloo")
print("started", flush=True)
time.sleep(120)
"""


class Train:
    """`clusterkit train ...` in a subprocess (its own session, as a terminal's job), its
    stdout and stderr read line by line as they come."""

    def __init__(self, args: list[str], cwd: Path, **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clusterkit", "train", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.changed = threading.Condition()
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream: Any, into: list[str]) -> None:
        for line in stream:
            with self.changed:
                into.append(line)
                self.changed.notify_all()

    def wait_for(self, pattern: str, lines: list[str], count: int = 1) -> None:
        """Until ``count`` lines match ``pattern`` (or the command ended: then it fails)."""
        regex = re.compile(pattern)

        def seen() -> bool:
            return sum(bool(regex.search(s)) for s in lines) >= count

        with self.changed:
            for _ in range(480):  # a bound, not a timing: the command ends long before
                if seen() or self.proc.poll() is not None:
                    break
                self.changed.wait(timeout=0.5)
            assert seen(), self.shown()

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=240)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        return code

    def shown(self) -> str:
        return "".join(self.out[-20:]) + "\n--- stderr ---\n" + "".join(self.err[-40:])


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "chatty.py").write_text(CHATTY)
    (folder / "failing.py").write_text(FAILING)
    (folder / "sleepy.py").write_text(SLEEPY)
    return folder


def local_profile(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text("backend: local\nworkers: 2\nworker: {threads: 1, memory: 1GiB}\n")
    return path


@pytest.fixture
def up_cluster(tmp_path: Path) -> Iterator[str]:
    record = api.up(local_profile(tmp_path, "ddpout"))
    try:
        yield record.name
    finally:
        api.down(record.name)


# ---------------------------------------------------------------- checks shared by the tiers


def check_live_whole_lines(project: Path, profile: str, hosts: int = 1) -> None:
    marker = project.parent / "warning-seen"
    train = Train(
        ["chatty.py", "--profile", profile, "--max-restarts", "1", "--", str(marker)], project
    )
    train.wait_for(r"^\[rank1\]: .*UserWarning: rank one warns mid-run$", train.err)
    marker.touch()  # rank 1 was still running, waiting for this
    assert train.finish() == 0, train.shown()
    line = re.compile(rf"^\[rank([01])\]: r\1 line (\d+) x{{{WIDTH}}}$")
    envs = ("[rank0]: env ", "[rank1]: env ")
    printed = [s.rstrip("\n") for s in train.out if not s.startswith(envs)]
    whole = [m for m in map(line.match, printed) if m]
    assert len(whole) == len(printed) == 2 * LINES, [s[:80] for s in printed if not line.match(s)]
    for rank in "01":  # in order within a rank
        assert [int(m[2]) for m in whole if m[1] == rank] == list(range(LINES))
    for rank in (0, 1):
        (env_line,) = [s for s in train.out if s.startswith(f"[rank{rank}]: env ")]
        env = json.loads(env_line.split(" env ", 1)[1])
        assert env["ROLE_RANK"] == str(rank) and env["ROLE_WORLD_SIZE"] == env["WORLD_SIZE"] == "2"
        assert env["ROLE_NAME"] == "default"  # torchrun's --role default
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert env["GROUP_WORLD_SIZE"] == str(hosts)
        assert int(env["GROUP_RANK"]) < hosts
    assert not any("raised in" in s for s in train.err), train.shown()  # shown once, live


def check_one_line_per_failed_rank(project: Path, profile: str) -> None:
    train = Train(["failing.py", "--profile", profile], project)
    assert train.finish() == 1, train.shown()
    for rank in (0, 1):
        assert f"[rank{rank}]: before the failure\n" in train.out, train.shown()
    assert train.err[-2:] == [
        "[rank1]: failed: ValueError: rank one gives up\n",
        "error: rank 1 failed: ValueError: rank one gives up "
        "(--tracebacks or CLUSTERKIT_DEBUG=1 prints the traceback)\n",
    ], train.shown()
    assert len(train.err) == 2, train.shown()  # no Compute Failed block, no traceback

    debug = Train(["failing.py", "--profile", profile], project, CLUSTERKIT_DEBUG="1")
    assert debug.finish() == 1, debug.shown()
    text = "".join(debug.err)
    assert "[rank1]: failed: ValueError: rank one gives up\n" in text
    assert "[rank1]: Traceback (most recent call last):\n" in text, debug.shown()
    assert '[rank1]:     raise ValueError("rank one gives up")\n' in text
    assert "Compute Failed" not in text


# ---------------------------------------------------------------- local tier


@pytest.mark.local
def test_train_on_an_up_cluster_streams_whole_lines_and_warnings_live(
    up_cluster: str, project: Path
) -> None:
    check_live_whole_lines(project, up_cluster)


@pytest.mark.local
def test_train_on_an_up_cluster_says_each_failed_rank_in_one_line(
    up_cluster: str, project: Path
) -> None:
    check_one_line_per_failed_rank(project, up_cluster)
    logs = subprocess.run(
        [sys.executable, "-m", "clusterkit", "logs", up_cluster, "-n", "500"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert logs.returncode == 0 and "distributed.worker" in logs.stdout, logs.stderr
    assert "Compute Failed" not in logs.stdout  # silenced on the worker itself


@pytest.mark.local
@pytest.mark.parametrize("where", ["up", "embedded"])
def test_ctrl_c_stops_the_training_in_one_line(
    where: str, tmp_path: Path, project: Path, request: pytest.FixtureRequest
) -> None:
    profile = (
        request.getfixturevalue("up_cluster")
        if where == "up"
        else str(local_profile(tmp_path, "embedded"))
    )
    train = Train(["sleepy.py", "--profile", profile], project)
    train.wait_for(r"^\[rank[01]\]: started$", train.out, count=2)
    os.killpg(train.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert train.finish() == 130, train.shown()
    assert train.err == ["interrupted: training sleepy.py stopped\n"], train.shown()


# ---------------------------------------------------------------- slurm tier


@pytest.mark.slurm
def test_train_on_an_up_slurm_cluster_streams_lines_and_fails_in_one_line(
    slurm: Any, tmp_path: Path, project: Path
) -> None:
    from tests.test_slurm import profile_file

    record = api.up(profile_file(tmp_path, "ddpslurm", workers=2, memory="2GiB"))
    try:
        check_live_whole_lines(project, record.name)
        check_one_line_per_failed_rank(project, record.name)
    finally:
        api.down(record.name)
