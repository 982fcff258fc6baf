"""Faults of the machine: a read-only or missing state directory, many `up`s and attaches at once.

Each gives a clear error or works, and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clusterkit import api, state

pytestmark = pytest.mark.local

CLI = [sys.executable, "-m", "clusterkit"]


def small(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text("backend: local\nworkers: 1\nscheduler: {dashboard: false}\n")
    return path


def test_read_only_state_dir_is_one_clear_error_and_starts_nothing(tmp_path: Path) -> None:
    readonly = tmp_path / "ro-state"
    (readonly / "clusters").mkdir(parents=True)  # as clusterkit made it, before it became ro
    for directory in (readonly, readonly / "clusters"):
        directory.chmod(0o700)
    # root ignores permission bits: make the directory a read-only bind of itself instead
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(readonly), str(readonly)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        mounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(readonly)],
                                 capture_output=True, text=True)
    assert mounted.returncode == 0, f"cannot make a read-only state dir here: {mounted.stderr}"
    try:
        env = {**os.environ, "CLUSTERKIT_STATE_DIR": str(readonly)}
        done = subprocess.run([*CLI, "up", str(small(tmp_path, "ro"))], capture_output=True,
                              text=True, timeout=120, env=env)
        assert done.returncode in (1, 2), done
        assert done.stderr.startswith("error: "), done.stderr
        assert "Traceback" not in done.stderr and "read-only" in done.stderr.lower(), done.stderr
        listed = subprocess.run([*CLI, "ls"], capture_output=True, text=True, timeout=60, env=env)
        assert listed.returncode == 0, listed.stderr
    finally:
        subprocess.run(["umount", str(readonly)], check=True)


def test_full_state_disk_is_one_clear_error_at_once_and_starts_nothing(tmp_path: Path) -> None:
    full = tmp_path / "full-state"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)],
                             capture_output=True, text=True)
    assert mounted.returncode == 0, f"cannot mount a small tmpfs here: {mounted.stderr}"
    try:
        # fill the disk to the last byte
        with open(full / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 4096)
        env = {**os.environ, "CLUSTERKIT_STATE_DIR": str(full)}
        began = time.monotonic()
        done = subprocess.run([*CLI, "up", str(small(tmp_path, "full"))], capture_output=True,
                              text=True, timeout=120, env=env)
        took = time.monotonic() - began
        assert done.returncode == 1, done
        assert done.stderr.startswith("error: state directory "), done.stderr
        assert "No space left on device" in done.stderr and "Traceback" not in done.stderr
        assert took < 30, f"a full disk took {took:.0f}s to report (a supervisor was waited on?)"
        listed = subprocess.run([*CLI, "ls"], capture_output=True, text=True, timeout=60, env=env)
        assert listed.returncode == 0, listed.stderr
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_ten_parallel_ups_of_different_names(tmp_path: Path) -> None:
    names = [f"par{i}" for i in range(10)]
    procs = [
        subprocess.Popen([*CLI, "up", str(small(tmp_path, name))], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for name in names
    ]
    try:
        results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
        assert [code for code, _ in results] == [0] * 10, results
        assert sorted(r.name for r in state.records()) == sorted(names)
        assert all(row["state"] == "up" for row in api.list_clusters())
    finally:
        done = subprocess.run([*CLI, "down", "--all", "--yes"], capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr
    assert state.records() == []


def test_twenty_parallel_attaches(tmp_path: Path) -> None:
    from clusterkit.client import get_client

    record = api.up(small(tmp_path, "shared"))
    try:
        def attach(i: int) -> int:
            with get_client("shared") as client:
                return int(client.submit(lambda x: x + 1, i).result(timeout=60))

        with ThreadPoolExecutor(20) as pool:
            assert sorted(pool.map(attach, range(20))) == list(range(1, 21))
    finally:
        api.down(record.name)
