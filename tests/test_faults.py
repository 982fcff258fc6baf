"""Faults of the machine: a read-only or full state directory, many `up`s and attaches at
once, two users on one machine, a state directory on a network file system.

Each gives a clear error or works, and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from clusterkit import api, state
from tests.test_ssh import Lab, lab  # noqa: F401 - fixture

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


SECOND_USER = "ck-second"


@dataclass
class User:
    """A second Unix user of this machine, running this checkout's clusterkit."""

    name: str
    uid: int
    home: Path

    def run(self, *args: str, timeout: float = 180,
            **extra: str) -> subprocess.CompletedProcess[str]:
        env = {"HOME": str(self.home), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
               "LANG": "C.UTF-8", **extra}
        command = ["runuser", "-u", self.name, "--", "env", "-i",
                   *(f"{key}={value}" for key, value in env.items()), sys.executable, *args]
        return subprocess.run(command, cwd=self.home, capture_output=True, text=True,
                              timeout=timeout)

    def processes(self) -> list[str]:
        import psutil

        return [f"{p.pid} {' '.join(p.cmdline())}" for p in psutil.process_iter()
                if p.uids().real == self.uid and p.status() != psutil.STATUS_ZOMBIE]


def _ancestors_closed_to_others(paths: list[Path]) -> set[Path]:
    """Directories on the way to ``paths`` that others cannot enter (e.g. /root, 0700)."""
    closed = set()
    for path in paths:
        for directory in [path, *path.parents]:
            if directory.is_dir() and not directory.stat().st_mode & 0o001:
                closed.add(directory)
    return closed


@pytest.fixture
def second_user() -> Iterator[User]:
    """A throwaway user; it may enter (x, by an ACL entry for it alone) the directories this
    interpreter and checkout sit in, since this machine's Python lives under /root (0700)."""
    if os.geteuid() != 0:
        pytest.skip("adding a second user needs root")
    subprocess.run(["userdel", "-r", SECOND_USER], capture_output=True)
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", SECOND_USER], check=True)
    import pwd

    entry = pwd.getpwnam(SECOND_USER)
    user = User(SECOND_USER, entry.pw_uid, Path(entry.pw_dir))
    root = Path(__file__).resolve().parent.parent
    interpreter = Path(sys.executable).resolve()
    granted = _ancestors_closed_to_others([root, Path(sys.prefix), interpreter.parent])
    try:
        for directory in granted:
            subprocess.run(["setfacl", "-m", f"u:{SECOND_USER}:x", str(directory)], check=True)
        yield user
    finally:
        subprocess.run(["pkill", "-KILL", "-u", SECOND_USER], capture_output=True)
        for directory in granted:
            subprocess.run(["setfacl", "-x", f"u:{SECOND_USER}", str(directory)],
                           capture_output=True)
        time.sleep(0.5)
        subprocess.run(["userdel", "-r", SECOND_USER], capture_output=True)


ON_WHICH_UID = """
import os, sys
from clusterkit import get_client
with get_client(sys.argv[1], timeout=30) as client:
    print(client.submit(os.getuid, pure=False).result(timeout=60))
"""


SHIPPED_SEARCH = """
from clusterkit.runners import hpo

def objective(trial):
    return trial.suggest_float("x", 0, 1)

hpo.run(objective, n_trials=2, workdir=".", storage=None, progress=False, max_retries=0)
"""


@pytest.mark.timeout(600)
def test_two_users_on_one_machine(tmp_path: Path, second_user: User) -> None:
    """Two users each bring up a cluster of the same name: each sees, uses and stops only its
    own (state under each home, workers' scratch space under each user), nothing is left."""
    import json

    from clusterkit.client import get_client

    profile = "backend: local\nworkers: 1\nscheduler: {dashboard: false}\n"
    (second_user.home / "twin.yaml").write_text(profile)
    os.chown(second_user.home / "twin.yaml", second_user.uid, -1)
    mine = api.up(small(tmp_path, "twin"))
    try:
        up = second_user.run("-m", "clusterkit", "up", "twin.yaml")
        assert up.returncode == 0, up.stderr
        listed = second_user.run("-m", "clusterkit", "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        theirs = json.loads(listed.stdout)
        assert [(row["name"], row["state"]) for row in theirs] == [("twin", "up")], theirs
        assert theirs[0]["address"] != mine.address
        on = second_user.run("-c", ON_WHICH_UID, "twin")
        assert on.returncode == 0, on.stderr
        assert int(on.stdout.split()[-1]) == second_user.uid
        with get_client("twin") as client:
            assert client.submit(os.getuid, pure=False).result(timeout=60) == os.getuid()
        # a project cache in the shared /tmp made first by someone else is refused, not used
        squatted = Path(tempfile.gettempdir()) / f"clusterkit-workdir-{second_user.uid}"
        squatted.mkdir(mode=0o777)
        try:
            squatted.chmod(0o777)
            search = second_user.run("-c", SHIPPED_SEARCH, CLUSTERKIT_WORKDIR_COPY="1")
        finally:
            shutil.rmtree(squatted)
        assert search.returncode != 0
        assert f"project cache {squatted} is not private to this user" in search.stderr, (
            search.stderr[-3000:])
        down = second_user.run("-m", "clusterkit", "down", "--all", "--yes")
        assert down.returncode == 0, down.stderr
        assert api.status("twin")["name"] == "twin", "the other user's down reached mine"
        left = second_user.run("-m", "clusterkit", "ls", "--json")
        assert json.loads(left.stdout) == [], left.stdout
        deadline = time.monotonic() + 15
        while second_user.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert second_user.processes() == [], "the second user's cluster left processes"
    finally:
        api.down(mine.name)
    assert state.records() == []


@contextlib.contextmanager
def network_mount(lab: Lab, export: Path, mountpoint: Path) -> Iterator[Path]:  # noqa: F811
    """``export`` mounted at ``mountpoint`` through sshfs (FUSE over the test's sshd): a state
    directory on a network file system, as an NFS home is on a cluster's login nodes."""
    export.mkdir()
    mountpoint.mkdir()
    options = (f"IdentityFile={lab.keys.client_key},UserKnownHostsFile={lab.known_hosts},"
               "StrictHostKeyChecking=yes")
    subprocess.run(["sshfs", "-p", str(lab.server.port), "-o", options,
                    f"root@127.0.0.1:{export}", str(mountpoint)], check=True, timeout=60)
    try:
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True, timeout=60)


def on_other_host(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The CLI as a second login node sharing the state directory would run it (own hostname,
    in a UTS namespace)."""
    command = " ".join(shlex.quote(a) for a in [*CLI, *args])
    return subprocess.run(["unshare", "--uts", "sh", "-c", f"hostname login2 && exec {command}"],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.ssh
@pytest.mark.timeout(600)
def test_state_directory_on_a_network_file_system(tmp_path: Path, lab: Lab) -> None:  # noqa: F811
    """The whole lifecycle with the state directory on a network mount (the control socket
    lives on the local disk: none can be made on sshfs), and a second host that shares it sees
    the cluster as running elsewhere: it neither probes it nor stops it."""
    import json

    with network_mount(lab, tmp_path / "export", tmp_path / "home") as home:
        env = {**os.environ, "CLUSTERKIT_STATE_DIR": str(home / "state")}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=180,
                                  env=env)

        up = cli("up", str(small(tmp_path, "shared-home")))
        assert up.returncode == 0, up.stderr
        try:
            rows = json.loads(cli("ls", "--json").stdout)
            assert [(r["name"], r["state"]) for r in rows] == [("shared-home", "up")], rows
            assert cli("scale", "shared-home", "2").returncode == 0
            assert cli("status", "shared-home").returncode == 0
            elsewhere = json.loads(on_other_host("ls", "--json", env=env).stdout)
            assert [r["state"] for r in elsewhere] == [f"up on host {socket.gethostname()}"]
            refused = on_other_host("down", "shared-home", env=env)
            assert refused.returncode == 2, refused
            assert "supervised on host" in refused.stderr and "Traceback" not in refused.stderr
            assert on_other_host("down", "--all", "--yes", env=env).returncode == 0
            assert cli("status", "shared-home").returncode == 0, "the other host stopped it"
        finally:
            down = cli("down", "shared-home")
        assert down.returncode == 0, down.stderr
        assert json.loads(cli("ls", "--json").stdout) == []
        left = (home / "state" / "clusters").iterdir()
        assert [p.name for p in left if p.suffix != ".lock"] == []  # lock files stay, by design


@dataclass
class Sites:
    scheduler: str  # network namespace, 10.233.0.1
    worker: str  # network namespace, 10.233.0.2
    worker_link: str  # the worker site's end of the veth pair


@pytest.fixture
def two_sites() -> Iterator[Sites]:
    """Two network namespaces joined by a veth pair: a scheduler's site and a worker's."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.fail("network namespaces need root and iproute2 (as in CI)")
    tag = f"{os.getpid() % 100000}"
    sites, links = (f"ck-s{tag}", f"ck-w{tag}"), (f"cks{tag}", f"ckw{tag}")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for site in sites:
            ip("netns", "add", site)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        addresses = ("10.233.0.1/24", "10.233.0.2/24")
        for site, link, address in zip(sites, links, addresses, strict=True):
            ip("link", "set", link, "netns", site)
            ip("-n", site, "addr", "add", address, "dev", link)
            ip("-n", site, "link", "set", "lo", "up")
            ip("-n", site, "link", "set", link, "up")
        yield Sites(sites[0], sites[1], links[1])
    finally:
        for site in sites:
            subprocess.run(["ip", "netns", "del", site], capture_output=True)


def test_workers_of_a_site_cut_off_stop_within_the_tcp_timeout(two_sites: Sites) -> None:
    """The README's bound for a scheduler that vanishes without a word (a partition): the
    worker, started as batch jobs start it, stops within Dask's TCP timeout."""
    scheduler_site, worker_site = two_sites.scheduler, two_sites.worker
    python = [sys.executable, "-m"]
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "15s"}
    scheduler = subprocess.Popen(
        ["ip", "netns", "exec", scheduler_site, *python, "distributed.cli.dask_scheduler",
         "--host", "10.233.0.1", "--port", "8786", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    worker_log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finally
    worker = subprocess.Popen(
        ["ip", "netns", "exec", worker_site, *python, "distributed.cli.dask_worker",
         "tcp://10.233.0.1:8786", "--nthreads", "1", "--death-timeout", "60", "--no-dashboard",
         "--host", "10.233.0.2"],
        stdout=worker_log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while b"Registered to" not in _read(worker_log) and time.monotonic() < deadline:
            assert worker.poll() is None, _read(worker_log).decode()[-2000:]
            time.sleep(0.2)
        assert b"Registered to" in _read(worker_log), _read(worker_log).decode()[-2000:]
        cut = ["ip", "-n", worker_site, "link", "set", two_sites.worker_link, "down"]
        subprocess.run(cut, check=True)
        started = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(60)
        took = time.monotonic() - started
        assert worker.poll() is not None, "the cut-off worker was still running after 60 s"
        assert took < 15 + 10, f"the worker stopped {took:.1f}s after the partition"
        print(f"cut-off worker stopped {took:.1f}s after the partition (tcp timeout 15s)")
    finally:
        for process in (worker, scheduler):
            process.kill()
            process.wait()
        worker_log.close()


def _read(handle: object) -> bytes:
    handle.seek(0)  # type: ignore[attr-defined]
    return handle.read()  # type: ignore[attr-defined, no-any-return]
