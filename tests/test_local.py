"""The local backend end to end with real processes: contract, races, failures, TLS, UCX."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest

import clusterkit
from clusterkit import api, state
from clusterkit.errors import ClusterExists, ClusterNotFound, ClusterStartError
from tests.contract import run_contract

pytestmark = pytest.mark.local


def profile_file(tmp_path: Path, text: str, name: str = "t") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_contract_local(tmp_path: Path) -> None:
    path = profile_file(tmp_path, """
        backend: local
        workers: 1
        worker: {threads: 1, memory: 1GiB}
        scheduler: {dashboard: false}
    """, "contract")
    record = run_contract(path, scale_to=2)
    assert record.address.startswith("tls://127.0.0.1:")  # mutual TLS by default
    assert oct(os.stat(state.clusters_dir()).st_mode & 0o777) == "0o700"


@pytest.mark.seam
def test_contract_embedded_local(tmp_path: Path) -> None:
    from tests.contract import run_embedded_contract

    run_embedded_contract(profile_file(tmp_path, """
        backend: local
        workers: 2
        worker: {threads: 1, memory: 1GiB}
        scheduler: {dashboard: false}
    """, "embedded"))


def test_contract_address_attaches_to_a_running_cluster(tmp_path: Path) -> None:
    from tests.contract import run_attach_contract

    record = api.up(profile_file(tmp_path, """
        backend: local
        workers: 2
        worker: {threads: 1, memory: 1GiB}
    """, "owner"))
    try:
        files = {k: record.security[k] for k in ("ca_file", "cert_file", "key_file")}
        run_attach_contract(profile_file(tmp_path, f"""
            backend: address
            address: {record.address}
            tls: {json.dumps(files)}
            workers: 2
        """, "attach"))
        assert api.status(record.name)["workers"], "attaching must not stop the owner's cluster"
    finally:
        api.down(record.name)


def test_cli_up_forks_its_supervisor_without_a_second_interpreter(tmp_path: Path) -> None:
    import psutil

    path = profile_file(tmp_path, "backend: local\nworkers: 1\n", "forked")
    cli = [sys.executable, "-m", "clusterkit"]
    done = subprocess.run([*cli, "up", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    record = state.read_record("forked")
    assert record is not None and record.pid is not None
    try:
        supervisor = psutil.Process(record.pid)
        assert "clusterkit.lifecycle.supervisor" not in " ".join(supervisor.cmdline())
        assert os.getpgid(record.pid) == record.pid, "the supervisor leads its own group"
        assert supervisor.ppid() != os.getpid(), "double fork: the supervisor is nobody's child"
    finally:
        api.down(record.name)


def test_library_up_from_a_threaded_process_starts_a_fresh_supervisor(tmp_path: Path) -> None:
    import threading

    import psutil

    from clusterkit.lifecycle import spawn

    gate = threading.Event()
    waiter = threading.Thread(target=gate.wait, daemon=True)
    waiter.start()  # forking now would copy a process with another thread: unsafe
    try:
        assert not spawn.can_fork()
        record = api.up(profile_file(tmp_path, "backend: local\nworkers: 1\n", "fresh"))
    finally:
        gate.set()
    try:
        assert record.pid is not None
        assert "clusterkit.lifecycle.supervisor" in " ".join(psutil.Process(record.pid).cmdline())
    finally:
        api.down(record.name)


def test_record_and_state_are_private(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "backend: local\nworkers: 1\n", "private")
    record = api.up(path)
    try:
        mode = os.stat(state.record_path(record.name)).st_mode & 0o777
        assert mode == 0o600
        assert os.stat(state.cluster_dir(record.name)).st_mode & 0o777 == 0o700
        with pytest.raises(ClusterExists, match="already up"):
            api.up(path)
    finally:
        api.down(record.name)
    with pytest.raises(ClusterNotFound):
        api.down(record.name)


def test_two_racing_ups_make_one_cluster(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "backend: local\nworkers: 1\n", "race")
    command = [sys.executable, "-m", "clusterkit", "up", str(path)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    try:
        codes = sorted(code for code, _ in results)
        assert codes == [0, 2], results
        loser = next(err for code, err in results if code == 2)
        assert "race" in loser and ("being started" in loser or "already up" in loser)
        assert [r.name for r in state.records()] == ["race"]
    finally:
        api.down("race")


def test_up_down_twenty_times_leaves_nothing(tmp_path: Path) -> None:
    path = profile_file(tmp_path, """
        backend: local
        workers: 1
        scheduler: {dashboard: false}
    """, "again")
    for _ in range(20):
        record = api.up(path)
        api.down(record.name)
        assert state.read_record("again") is None
        assert not state.pid_alive(record.pid)
    assert state.records() == []


@pytest.mark.parametrize(("body", "component", "evidence"), [
    ("preload: [clusterkit_no_such_module]", "local workers", "clusterkit_no_such_module"),
    ("scheduler: {interface: nosuch0}", "local workers", "nosuch0"),
    ("worker: {memory: 100TiB}", "local workers", "this machine has"),
], ids=["unimportable-preload", "bad-interface", "memory-does-not-fit"])
def test_start_failures_name_component_and_leave_nothing(
    tmp_path: Path, body: str, component: str, evidence: str
) -> None:
    text = f"backend: local\nworkers: 1\nstart_timeout: 30s\n{body}\n"
    path = profile_file(tmp_path, text, "bad")
    with pytest.raises(ClusterStartError) as info:
        api.up(path)
    assert info.value.component == component
    assert evidence in info.value.details()
    assert state.read_record("bad") is None
    assert not (state.clusters_dir() / "bad").exists()
    with pytest.raises(ClusterStartError) as embedded:
        clusterkit.get_client(path)
    assert evidence in embedded.value.details()


def test_cli_up_failure_exit_1_with_stderr_tail(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "backend: local\nworkers: 1\npreload: [ck_missing_mod]\n", "cli")
    done = subprocess.run([sys.executable, "-m", "clusterkit", "up", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("error: local workers: could not start")
    assert "ck_missing_mod" in done.stderr and "Traceback" not in done.stderr.splitlines()[0]


def test_cli_up_of_an_invalid_profile_exits_2_and_leaves_nothing(tmp_path: Path) -> None:
    """A profile that fails validation: exit 2, one line, no process, record or directory."""
    from tests.conftest import token_processes, wait_gone

    path = profile_file(tmp_path, "backend: local\nworkers: many\n", "invalid")
    before = token_processes()
    done = subprocess.run([sys.executable, "-m", "clusterkit", "up", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, done.stderr
    assert "workers" in done.stderr
    assert wait_gone(before, seconds=30) == set()
    assert state.read_record("invalid") is None
    assert not (state.clusters_dir() / "invalid").exists()


def test_a_failed_up_ends_its_warm_supervisor_at_once(tmp_path: Path) -> None:
    """`up` forks the supervisor before it reads the profile; an `up` that fails after that
    (invalid profile, a name already up) kills it before it returns, not once the supervisor
    has finished importing and found no job."""
    from tests.conftest import describe, token_processes

    cli = [sys.executable, "-m", "clusterkit", "up"]
    invalid = profile_file(tmp_path, "backend: local\nworkers: many\n", "invalid")
    record = api.up(profile_file(tmp_path, "backend: local\nworkers: 1\n", "taken"))
    try:
        for path, code in ((invalid, 2), (tmp_path / "taken.yaml", 2)):
            before = token_processes()
            done = subprocess.run([*cli, str(path)], capture_output=True, text=True, timeout=120)
            left = token_processes() - before  # no waiting: killed, not left to time out
            assert done.returncode == code, done.stderr
            assert left == set(), describe(left)
    finally:
        api.down(record.name)


def test_cli_lifecycle(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "backend: local\nworkers: 1\n", "clitest")

    def ck(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "clusterkit", *args], capture_output=True,
                              text=True, timeout=120)

    started = ck("up", str(path))
    assert started.returncode == 0, started.stderr
    try:
        address = started.stdout.strip()
        assert address.startswith("tls://127.0.0.1:")
        assert address in ck("ls").stdout
        assert '"threads": 1' in ck("status", "clitest", "--json").stdout
        assert ck("scale", "clitest", "2").returncode == 0
        assert ck("status", "clitest", "--json").stdout.count('"address": "tls://') == 3
        assert "==> scheduler <==" in ck("logs", "clitest").stdout
        assert ck("dashboard", "clitest").stdout.startswith("http://127.0.0.1:")
        assert ck("up", str(path)).returncode == 2
    finally:
        done = ck("down", "--all")
    assert done.returncode == 0 and "down clitest" in done.stderr
    assert ck("status", "clitest").returncode == 2


def test_get_client_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = profile_file(tmp_path, "backend: local\nworkers: 1\n", "resolve")
    record = api.up(path)
    try:
        monkeypatch.setenv("CLUSTERKIT_PROFILE", "resolve")
        with clusterkit.get_client() as client:  # CLUSTERKIT_PROFILE -> live record
            assert client.scheduler.address == record.address
            # inside a task, get_client() is the worker's client on the same scheduler
            inner = client.submit(lambda: clusterkit.get_client().scheduler.address).result()
            assert inner == record.address
        monkeypatch.setenv("CLUSTERKIT_SCHEDULER", record.address)
        monkeypatch.setenv("CLUSTERKIT_SECURITY", str(Path(record.security["key_file"]).parent))
        with clusterkit.get_client("ignored-name") as client:
            assert client.submit(sum, [1, 1]).result() == 2
    finally:
        api.down("resolve")


@pytest.mark.seam
def test_embedded_cluster_closes_with_client(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "backend: local\nworkers: 2\n", "emb")
    client = clusterkit.get_client(path)
    assert type(client).__name__ == "Client" and type(client).__module__ == "distributed.client"
    assert len(client.scheduler_info()["workers"]) == 2
    client.close()
    with clusterkit.cluster(path) as (cluster, client):
        assert client.submit(sum, [2, 3]).result() == 5
    assert cluster.status.name == "closed"


@pytest.mark.seam
def test_closing_an_embedded_client_ends_its_event_loop(tmp_path: Path) -> None:
    """Once the client is closed, its cluster's event loop thread is gone, not left for the
    garbage collector: that ended it from whatever thread collected, under distributed's
    class-wide LoopRunner lock, so a LocalCluster starting in another thread could wait 10 s
    and fail (``assert loop is not None``)."""
    import gc
    import threading

    path = profile_file(tmp_path, "backend: local\nworkers: 1\n", "loop")
    before = set(threading.enumerate())
    gc.disable()  # the collector must not be what ends the loop
    try:
        client = clusterkit.get_client(path)
        assert client.submit(sum, [1, 2]).result() == 3
        client.close()
        left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    finally:
        gc.enable()
    assert "IO loop" not in left, left


@pytest.mark.seam
def test_a_closed_client_collected_while_a_cluster_starts_does_not_hang(tmp_path: Path) -> None:
    """The garbage collector may end a closed embedded client on a thread that holds
    distributed's class-wide ``LoopRunner`` lock (it runs whenever that thread allocates, e.g.
    while ``LoopRunner.start`` starts the next cluster's loop). Its finalizer closed the cluster
    again, which takes that lock: run there, it waited on its own thread for ever (a test
    after an in-process ``clusterkit train`` hung until pytest's timeout). It must return."""
    import gc
    import threading

    from distributed.utils import LoopRunner

    path = profile_file(tmp_path, "backend: local\nworkers: 1\n", "collected")
    client = clusterkit.get_client(path)
    cluster, collected = client.cluster, weakref.ref(client)
    assert client.submit(sum, [1, 2]).result() == 3
    client.close()
    lock = LoopRunner._lock

    def collect_holding_the_lock() -> None:
        lock.acquire()  # as LoopRunner.start holds it while it allocates
        try:
            gc.collect()
        finally:
            with contextlib.suppress(RuntimeError):  # released by the test on a hang
                lock.release()

    gc.disable()  # only the collection under the lock may end the client
    try:
        del client
        collector = threading.Thread(target=collect_holding_the_lock)
        collector.start()
        collector.join(timeout=30)
        hung = collector.is_alive()
        if hung:
            lock.release()  # let the finalizer through, so this process goes on
            collector.join(timeout=30)
    finally:
        gc.enable()
    assert not hung, "the client's finalizer waited on the lock its own thread held"
    assert collected() is None, "the client was not collected: the test did not test"
    assert cluster.status.name == "closed"


def test_a_dashboard_off_profile_never_asks_for_8787(tmp_path: Path) -> None:
    """The scheduler's HTTP server (health, metrics) goes to port 0 with the dashboard off:
    with 8787 taken, no 'Port 8787 is already in use' warning reaches the user."""
    import contextlib
    import socket
    import warnings

    path = profile_file(tmp_path, "backend: local\nworkers: 1\nscheduler: {dashboard: false}\n")
    with socket.socket() as taken, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # someone else holds it: the same condition
            taken.bind(("127.0.0.1", 8787))
        taken.listen()
        with clusterkit.cluster(path) as (_cluster, client):
            assert client.submit(sum, [1, 2]).result() == 3
    assert [str(w.message) for w in caught if "8787" in str(w.message)] == []


REFUSED = textwrap.dedent("""
    import sys
    from distributed import Client
    try:
        Client(sys.argv[1], timeout=3).close()
        print("connected")
    except OSError:
        print("OSError")
    except TypeError:
        print("TypeError")
""")


def refused_with(address: str) -> str:
    done = subprocess.run([sys.executable, "-c", REFUSED, address], capture_output=True,
                          text=True, timeout=60)
    return done.stdout.strip()


def test_tls_accepts_certificates_and_refuses_without(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "backend: local\nprotocol: tls\nworkers: 1\n", "secure")
    record = api.up(path)
    try:
        assert record.address.startswith("tls://127.0.0.1:")
        for file in record.security.values():
            if isinstance(file, str) and file.endswith(".pem"):
                assert os.stat(file).st_mode & 0o777 == 0o600
        with clusterkit.get_client("secure") as client:
            assert client.submit(sum, [1, 2]).result() == 3
        # trusting the cluster's CA but presenting no certificate: the server refuses
        import socket
        import ssl

        context = ssl.create_default_context(cafile=record.security["ca_file"])
        context.check_hostname = False
        host, port = record.address.removeprefix("tls://").rsplit(":", 1)
        with (
            socket.create_connection((host, int(port)), timeout=10) as raw,
            # the server answers with the TLS alert or just hangs up: either way, refused
            pytest.raises(ssl.SSLError, match=r"CERTIFICATE_REQUIRED|certificate|EOF occurred"),
            context.wrap_socket(raw) as tls,
        ):
            tls.sendall(b"\0" * 8)
            tls.recv(1)  # TLS 1.3 delivers the server's refusal here
        # clients with no TLS settings, in fresh processes (a failed Client start leaves the
        # process's event-loop runner unusable for the next one)
        plain = record.address.replace("tls://", "tcp://")
        for address, expected in ((record.address, "TypeError"), (plain, "OSError")):
            assert refused_with(address) == expected
    finally:
        api.down("secure")


UCX_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, clusterkit
    if __name__ == "__main__":
        with clusterkit.cluster(sys.argv[1]) as (cluster, client):
            assert client.scheduler.address.startswith("ucx://"), client.scheduler.address
            a, b = sorted(client.scheduler_info()["workers"])
            data = client.submit(np.ones, 10_000_000, workers=[a], pure=False)  # 80 MB
            total = client.submit(np.sum, data, workers=[b], allow_other_workers=False)
            print(int(total.result()))
""")


@pytest.mark.cuda_extra  # distributed-ucxx: the ucx extra, a RAPIDS release (compat leaves it out)
def test_ucx_moves_a_large_array_between_workers(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "backend: local\nprotocol: ucx\nworkers: 2\n", "ucx")
    script = tmp_path / "ucx_move.py"
    script.write_text(UCX_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "10000000"


def test_doctor_passes_on_local() -> None:
    from clusterkit.doctor import run_checks
    from clusterkit.profiles import load_profile

    checks = {c.name: c for c in run_checks(load_profile("local"))}
    assert all(c.ok for c in checks.values()), checks
    assert "task ran via tls://127.0.0.1:" in checks["worker -> scheduler connection"].detail


def _corrupt(name: str) -> None:
    state.record_path(name).write_text('{"garbage": tru')


def test_unreadable_record_never_hides_a_running_cluster(tmp_path: Path) -> None:
    import psutil

    record = api.up(profile_file(tmp_path, "backend: local\nworkers: 1\n", "torn"))
    supervisor = psutil.Process(record.pid)
    try:
        _corrupt("torn")
        listed = {row["name"]: row for row in api.list_clusters()}
        assert listed["torn"]["state"].startswith("unreadable: JSONDecodeError")
        assert listed["torn"]["address"] == str(state.record_path("torn"))
        # status asks the supervisor for its record and writes it again
        assert api.status("torn")["address"] == record.address
        assert state.read_record("torn") == record
        # with neither record nor control socket, down still finds it by its pid file
        _corrupt("torn")
        state.control_socket("torn").unlink()
        with pytest.raises(clusterkit.ClusterkitError, match="still runs"):
            api.status("torn")
    finally:
        api.down("torn")
    supervisor.wait(timeout=30)
    assert not state.pid_alive(record.pid)
    assert state.load_record("torn") is None and api.list_clusters() == []


def test_cli_ls_shows_an_unreadable_record_with_its_path(tmp_path: Path) -> None:
    state.clusters_dir().mkdir(parents=True, exist_ok=True)
    state.record_path("junk").write_text("not json")
    cli = [sys.executable, "-m", "clusterkit"]
    done = subprocess.run([*cli, "ls", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"state": "unreadable: JSONDecodeError' in done.stdout
    gone = subprocess.run([*cli, "down", "junk"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0, gone.stderr
    assert not state.record_path("junk").exists()


def test_dead_supervisor_is_listed_and_down_reaps_its_workers(tmp_path: Path) -> None:
    import signal

    import psutil

    record = api.up(profile_file(tmp_path, "backend: local\nworkers: 2\n", "orphaned"))
    assert record.pid is not None
    group = [p for p in psutil.process_iter() if _pgid(p.pid) == record.pid]
    assert len(group) >= 3, "supervisor and its worker processes share one group"
    os.kill(record.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(record.pid)], timeout=10)
    rows = {row["name"]: row for row in api.list_clusters()}
    assert rows["orphaned"]["state"].startswith("dead"), rows
    with pytest.raises(ClusterNotFound, match="is dead"):
        api.status("orphaned")
    api.down("orphaned")
    _gone, alive = psutil.wait_procs(group, timeout=15)
    assert alive == [], f"left running: {alive}"
    assert state.load_record("orphaned") is None


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def test_workers_stop_by_themselves_when_their_scheduler_is_gone(tmp_path: Path) -> None:
    import signal

    import psutil

    # not 3 s: under CI's load a worker can take that long to reach its scheduler at start, and
    # a nanny whose worker never did left the supervisor's start hanging (no answer in 90 s)
    text = "backend: local\nworkers: 2\ndeath_timeout: 8s\n"
    record = api.up(profile_file(tmp_path, text, "headless"))
    assert record.pid is not None
    workers = [
        p for p in psutil.process_iter() if _pgid(p.pid) == record.pid and p.pid != record.pid
    ]
    assert workers
    os.kill(record.pid, signal.SIGKILL)  # the scheduler runs in the supervisor: both gone
    started = time.monotonic()
    _gone, alive = psutil.wait_procs(workers, timeout=60)
    took = time.monotonic() - started
    assert alive == [], f"workers still running {took:.0f}s after their scheduler died"
    print(f"workers stopped {took:.1f}s after the scheduler died (death_timeout 8s)")
    api.down("headless")


def test_embedded_script_exits_without_dask_noise(tmp_path: Path) -> None:
    """A script that keeps its futures until it exits: the embedded cluster stops with it, and
    the scheduler's 'lose already computed task(s)' warning (meaningless then) is not shown."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        from clusterkit import get_client

        if __name__ == "__main__":
            client = get_client()
            futures = client.map(lambda x: x + 1, range(10))
            print(sum(client.gather(futures)))
    """))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "55", done.stderr
    assert "lose already computed" not in done.stderr, done.stderr


def _exit_hook_in_worker(marker: str) -> bool:
    """Run in a worker: register an exit hook that writes ``marker``; is the heap to be
    frozen at exit (the quick-exit preload loaded)?"""
    import atexit
    import sys
    from pathlib import Path

    atexit.register(Path(marker).write_text, "ran")
    return "clusterkit.backends.quick_exit" in sys.modules


def test_local_workers_end_quickly_and_still_run_their_exit_hooks(tmp_path: Path) -> None:
    """Worker processes skip the final garbage collection, not their exit hooks: a hook a task
    registers still runs when the cluster closes, and the close waits for the processes."""
    path = profile_file(tmp_path, "backend: local\nworkers: 2\n", "quick")
    with clusterkit.cluster(path) as (_cluster, client):
        workers = client.scheduler_info()["workers"]
        markers = {w: str(tmp_path / f"exit-{n}") for n, w in enumerate(workers)}
        for worker, marker in markers.items():
            assert client.submit(_exit_hook_in_worker, marker, workers=[worker]).result()
    assert all(Path(m).read_text() == "ran" for m in markers.values())


def test_threaded_local_workers_leave_this_process_exit_alone(tmp_path: Path) -> None:
    """``processes: false`` runs workers in the caller's own process: no quick-exit preload."""
    path = profile_file(tmp_path, "backend: local\nworkers: 1\nprocesses: false\n", "threads")
    script = (
        "import sys, clusterkit\n"
        f"with clusterkit.cluster({str(path)!r}) as (_, client):\n"
        "    client.submit(sum, [1]).result()\n"
        "print('clusterkit.backends.quick_exit' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"
