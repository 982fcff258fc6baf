"""The ssh backend against a real sshd on 127.0.0.1, and two hosts in network namespaces."""

from __future__ import annotations

import json
import logging
import os
import ssl
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clusterkit.backends.ssh import backend as ssh
from clusterkit.backends.ssh.backend import SSHBackend
from clusterkit.errors import ClusterStartError
from clusterkit.schema import SSHProfile
from clusterkit.security import SERVER_NAMES, ClusterSecurity, prepare
from tests import sshd as S

SSH = SSHBackend()

pytestmark = pytest.mark.ssh


@dataclass
class Lab:
    keys: S.Keys
    server: S.Sshd
    known_hosts: Path

    def profile(self, name: str = "lab", **fields: Any) -> SSHProfile:
        data: dict[str, Any] = {
            "backend": "ssh",
            "hosts": ["127.0.0.1"],
            "port": self.server.port,
            "user": "root",
            "identity_files": [str(self.keys.client_key)],
            "known_hosts": str(self.known_hosts),
            "remote_python": sys.executable,
            "start_timeout": 40,
            "scheduler": {"dashboard": False},
        }
        data.update(fields)
        return SSHProfile.model_validate(data).named(name)  # type: ignore[return-value]


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    reason = S.missing_reason()
    if reason:
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("ssh")
    keys = S.Keys.generate(directory)
    server = S.start_sshd(keys, "lo")
    try:
        yield Lab(keys, server, S.write_known_hosts(directory / "known_hosts", keys, [server]))
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def no_remote_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Remote processes do not inherit the test token: look for them by their SSH_CONNECTION."""
    yield
    if "lab" not in request.fixturenames:
        return
    lab: Lab = request.getfixturevalue("lab")
    left = S.wait_no_remote_processes([lab.server])
    if left:
        S.kill_all(left)
        pytest.fail(f"remote processes left running: {left}", pytrace=False)


def tcp() -> ClusterSecurity:
    return ClusterSecurity(protocol="tcp")


# ------------------------------------------------------------------ render, options


def test_render_shows_each_host_and_binding(lab: Lab) -> None:
    profile = lab.profile(
        hosts=["127.0.0.1", "127.0.0.2"],
        workers_per_host=2,
        preload=["json"],
        env={"OMP_NUM_THREADS": "1"},
        worker={"threads": 3, "memory": "1GiB"},
    )
    text = ssh.render(profile, tcp())
    assert "[127.0.0.1]" in text and "[127.0.0.2]" in text
    assert "OMP_NUM_THREADS=1" in text and "CLUSTERKIT_CLUSTER=" in text
    assert '"host": "127.0.0.2"' in text and '"host": "127.0.0.1"' in text
    assert '"nthreads": 3' in text and f'"memory_limit": {2**30}' in text
    assert '"preload": ["json"]' in text and "distributed.Nanny" in text
    assert text.count("distributed.Scheduler") == 1
    assert f"port {lab.server.port}" in text and str(lab.known_hosts) in text


def test_render_gpu_uses_dask_cuda_and_gpu_resource(lab: Lab) -> None:
    profile = lab.profile(worker={"gpus": 2}, hosts=["127.0.0.1", "127.0.0.2"])
    text = ssh.render(profile, tcp())
    assert "dask_cuda.CUDAWorker" in text and '"resources": "GPU=1"' in text  # its CLI form
    assert "CUDA_VISIBLE_DEVICES=0,1" in text and profile.min_workers == 4
    with pytest.raises(ValueError, match="workers_per_host"):
        lab.profile(worker={"gpus": 1}, workers_per_host=2)


def test_render_tls_points_at_private_remote_copies(lab: Lab) -> None:
    security = ClusterSecurity.in_directory("/x")
    text = ssh.render(lab.profile(), security)  # mutual TLS: the default
    assert "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION=True" in text
    assert "$HOME/.clusterkit/run/<cluster-id>/worker-key.pem" in text
    assert "$HOME/.clusterkit/run/<cluster-id>/scheduler-key.pem" in text
    assert '"protocol": "tls"' in text
    assert "/x/" not in text  # local paths never reach the hosts' command lines
    assert "/key.pem" not in text  # nor does the client's key


def test_host_keys_strict_by_default_and_warned_when_off(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    strict = ssh.ssh_spec.connect_options(lab.profile())
    assert strict["known_hosts"] == str(lab.known_hosts)
    with caplog.at_level(logging.WARNING):
        loose = ssh.ssh_spec.connect_options(lab.profile(strict_host_keys=False))
    assert loose["known_hosts"] is None
    assert "NOT verified" in caplog.text


# ------------------------------------------------------------------ a real cluster


def test_create_cluster_runs_tasks_on_bound_workers(lab: Lab) -> None:
    from distributed import Client

    profile = lab.profile(hosts=["127.0.0.1", "127.0.0.1"], worker={"resources": {"FOO": 1}})
    cluster = SSH.create(profile, tcp(), name="test")
    try:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=30)
            workers = client.scheduler_info(n_workers=-1)["workers"]
            assert all(a.startswith("tcp://127.0.0.1:") for a in workers)
            assert all(w["resources"] == {"FOO": 1} for w in workers.values())
            assert client.submit(lambda x: x + 1, 41).result(timeout=30) == 42
            # the remote processes carry the profile's env and the cluster marker
            env = client.run(lambda: os.environ.get("CLUSTERKIT_CLUSTER"))
            assert len(set(env.values())) == 1 and None not in env.values()
    finally:
        cluster.close()


def test_contract_up_get_client_scale_down(lab: Lab) -> None:
    from tests.contract import run_contract

    profile = lab.profile(f"ssh-contract-{uuid.uuid4().hex[:6]}", hosts=["127.0.0.1"] * 2)
    run_contract(profile, scale_to=3)


def test_tls_cluster_refuses_clients_without_its_certificates(lab: Lab, tmp_path: Path) -> None:
    from distributed import Client

    from clusterkit import api
    from clusterkit.client import get_client

    name = f"ssh-tls-{uuid.uuid4().hex[:6]}"
    record = api.up(lab.profile(name, protocol="tls"))
    try:
        assert record.address.startswith("tls://127.0.0.1:")
        with get_client(name) as client:
            assert client.submit(lambda: 7).result(timeout=30) == 7
            dirs = client.run(
                lambda: os.path.dirname(os.environ["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"])
            )
        (remote,) = set(dirs.values())
        assert stat.S_IMODE(os.stat(remote).st_mode) == 0o700
        assert sorted(os.listdir(remote)) == sorted(SERVER_NAMES)  # not the client's key
        for name_ in SERVER_NAMES:
            assert stat.S_IMODE(os.stat(f"{remote}/{name_}").st_mode) == 0o600
        plain = "tcp://" + record.address.split("://", 1)[1]
        with pytest.raises((OSError, TimeoutError)):
            Client(plain, timeout=3)
        own_ca = prepare(lab.profile(protocol="tls"), tmp_path / "stranger", []).distributed()
        with pytest.raises((OSError, TimeoutError, ssl.SSLError)):
            Client(record.address, security=own_ca, timeout=3)
    finally:
        api.down(name)
    assert not os.path.exists(remote), "the remote TLS directory outlived the cluster"


# ------------------------------------------------------------------ failures


def _assert_start_fails(profile: SSHProfile, *needles: str) -> ClusterStartError:
    started = time.monotonic()
    with pytest.raises(ClusterStartError) as caught:
        SSH.create(profile, tcp(), name="test")
    elapsed = time.monotonic() - started
    error = caught.value
    assert error.component == "ssh 127.0.0.1" and "127.0.0.1" in error.one_line()
    assert elapsed < profile.start_timeout + 5
    text = error.details()
    for needle in needles:
        assert needle in text, text
    return error


def test_unreachable_host(lab: Lab) -> None:
    _assert_start_fails(lab.profile(port=S.free_port(), start_timeout=10), "unreachable")


def test_refused_key(lab: Lab) -> None:
    _assert_start_fails(lab.profile(identity_files=[str(lab.keys.stranger_key)]), "login refused")


def test_changed_host_key(lab: Lab, tmp_path: Path) -> None:
    other = S.Keys.generate(tmp_path)
    known = tmp_path / "known_hosts"
    known.write_text(f"{lab.server.known_hosts_entry_host} {other.host_public()}\n")
    _assert_start_fails(lab.profile(known_hosts=str(known)), "host key not verifiable")


def test_missing_remote_python(lab: Lab) -> None:
    error = _assert_start_fails(
        lab.profile(remote_python="/opt/nowhere/bin/python"),
        "/opt/nowhere/bin/python",
        "No such file",
    )
    assert "scheduler" in error.message


def test_remote_import_error_in_preload(lab: Lab) -> None:
    error = _assert_start_fails(
        lab.profile(preload=["clusterkit_no_such_module"]), "clusterkit_no_such_module"
    )
    assert "worker" in error.message


def test_up_failure_reaches_the_caller_with_evidence(lab: Lab) -> None:
    from clusterkit import api, state

    name = f"ssh-bad-{uuid.uuid4().hex[:6]}"
    with pytest.raises(ClusterStartError) as caught:
        api.up(lab.profile(name, remote_python="/opt/nowhere/bin/python"))
    assert caught.value.component == "ssh 127.0.0.1"
    assert any("No such file" in line for line in caught.value.evidence)
    assert state.read_record(name) is None


# ------------------------------------------------------------------ doctor


def test_doctor_checks_each_host(lab: Lab) -> None:
    checks = SSH.doctor(lab.profile(hosts=["127.0.0.1"]), tcp())
    names = {c.name: c for c in checks}
    for key in ("login", "python", "dask", "distributed", "reaches scheduler"):
        assert names[f"127.0.0.1: {key}"].ok, checks
    bad = SSH.doctor(lab.profile(remote_python="/opt/nowhere/bin/python"), tcp())
    assert [c.name for c in bad if not c.ok] == ["127.0.0.1: python"]
    refused = SSH.doctor(lab.profile(identity_files=[str(lab.keys.stranger_key)]), tcp())
    assert not refused[0].ok and "login refused" in refused[0].detail


def test_doctor_without_host_key_checks_logs_in(lab: Lab, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    assert not SSH.doctor(lab.profile(known_hosts=str(empty)), tcp())[0].ok
    checks = SSH.doctor(lab.profile(known_hosts=str(empty), strict_host_keys=False), tcp())
    assert all(c.ok for c in checks), checks


# ------------------------------------------------------------------ two hosts (netns)

DRIVER = textwrap.dedent("""
    import json, sys
    from distributed import Client
    from clusterkit.backends.ssh.backend import SSHBackend
    from clusterkit.schema import SSHProfile
    from clusterkit.security import ClusterSecurity
    profile = SSHProfile.model_validate(json.loads(sys.argv[1])).named("two-hosts")
    cluster = SSHBackend().create(profile, ClusterSecurity(protocol="tcp"), name="two-hosts")
    try:
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            hosts = client.run(lambda: __import__("socket").gethostname())
            total = client.submit(sum, [1, 2, 3]).result(timeout=60)
            print(json.dumps({"scheduler": cluster.scheduler_address,
                              "workers": sorted(hosts), "total": total}))
    finally:
        cluster.close()
""")


def test_two_hosts_in_network_namespaces(tmp_path: Path) -> None:
    reason = S.missing_reason() or S.netns_reason()
    if reason:
        pytest.skip(reason)
    keys = S.Keys.generate(tmp_path / "keys")
    with S.two_hosts() as net:
        servers = [
            S.start_sshd(keys, f"ns{i}", listen=address, port=22, netns=ns)
            for i, (ns, address) in enumerate(zip(net.names, net.addresses, strict=True))
        ]
        try:
            known = S.write_known_hosts(tmp_path / "known_hosts", keys, servers)
            a, b = net.addresses
            profile = {
                "backend": "ssh",
                "hosts": [a, b],
                "user": "root",
                "identity_files": [str(keys.client_key)],
                "known_hosts": str(known),
                "remote_python": sys.executable,
                "start_timeout": 60,
                "scheduler": {"dashboard": False},
            }
            done = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    net.names[0],
                    sys.executable,
                    "-c",
                    DRIVER,
                    json.dumps(profile),
                ],
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads(done.stdout.strip().splitlines()[-1])
            assert result["scheduler"].startswith(f"tcp://{a}:")
            assert [w.split("://")[1].split(":")[0] for w in result["workers"]] == [a, b]
            assert result["total"] == 6
            left = S.wait_no_remote_processes(servers)
            S.kill_all(left)
            assert not left, f"remote processes left running: {left}"
        finally:
            for server in servers:
                server.stop()


def test_killed_supervisor_leaves_remote_processes_that_down_reaps(lab: Lab) -> None:
    import signal

    import psutil

    from clusterkit import api, state

    name = f"ssh-dead-{uuid.uuid4().hex[:6]}"
    record = api.up(lab.profile(name, protocol="tls"))
    cluster_id = record.extra["cluster_id"]
    assert cluster_id.startswith(name)  # remote processes and folders carry the cluster's name
    remote_dir = Path.home() / ".clusterkit" / "run" / cluster_id
    assert remote_dir.is_dir()
    os.kill(record.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(record.pid)], timeout=10)
    time.sleep(2)
    assert S.remote_processes([lab.server]), "the remote scheduler and worker outlive a SIGKILL"
    api.down(name)
    assert S.wait_no_remote_processes([lab.server]) == {}
    assert not remote_dir.exists()
    assert state.load_record(name) is None


def test_supervisor_killed_mid_start_leaves_no_remote_process(lab: Lab, tmp_path: Path) -> None:
    """SIGKILL of the supervisor once the remote scheduler runs, before the cluster is up: the
    claim written before anything started names the remote tag, so nothing outlives `up`'s
    failure and `down`. (It left the remote scheduler running: found by bench/chaos.py.)"""
    import signal

    import yaml

    from clusterkit import api, state

    name = f"ssh-mid-{uuid.uuid4().hex[:6]}"
    profile = tmp_path / "mid.yaml"
    data = lab.profile(name, workers_per_host=1).model_dump(mode="json")
    profile.write_text(yaml.safe_dump({**data, "start_timeout": 60}))
    up = subprocess.Popen(
        [sys.executable, "-m", "clusterkit", "up", str(profile), "--name", name],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(
            "distributed.Scheduler" in cmd for cmd in S.remote_processes([lab.server]).values()
        ):
            assert up.poll() is None and time.monotonic() < deadline, "no remote scheduler"
            time.sleep(0.02)
        claim = state.read_record(name)
        assert claim is not None and claim.starting, "no claim before the cluster was up"
        assert claim.extra["cluster_id"].startswith(f"{name}-")
        supervisor = state.supervisor_pid(name)
        assert supervisor is not None
        os.kill(supervisor, signal.SIGKILL)
        _, err = up.communicate(timeout=120)
        assert up.returncode != 0, err
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    subprocess.run(
        [sys.executable, "-m", "clusterkit", "down", name], capture_output=True, timeout=120
    )
    left = S.wait_no_remote_processes([lab.server])
    S.kill_all(left)
    assert left == {}, f"remote processes left running: {left}"
    assert api.list_clusters() == []


def test_doctor_names_a_missing_key_file(lab: Lab) -> None:
    checks = SSH.doctor(lab.profile(identity_files=["/nonexistent/id_ed25519"]), tcp())
    assert not checks[0].ok and "/nonexistent/id_ed25519" in checks[0].detail


def test_embedded_remote_cluster_says_it_ends_with_the_process(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    from clusterkit.client import get_client

    with caplog.at_level(logging.WARNING, logger="clusterkit.client"):
        client = get_client(lab.profile(f"ssh-embedded-{uuid.uuid4().hex[:6]}"))
        client.close()
    lines = [r.getMessage() for r in caplog.records]
    line = next(text for text in lines if "ends with this process" in text)
    assert "embedded ssh cluster" in line and "clusterkit up ssh-embedded-" in line


def test_remote_workers_stop_by_themselves_when_their_scheduler_is_gone(lab: Lab) -> None:
    import signal

    import psutil

    from clusterkit import api

    name = f"ssh-headless-{uuid.uuid4().hex[:6]}"
    record = api.up(lab.profile(name, death_timeout="5s"))
    os.kill(record.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(record.pid)], timeout=10)
    started = time.monotonic()
    # the remote scheduler outlives its SIGKILLed supervisor: stop it as a crashed host would
    remote = S.remote_processes([lab.server])
    schedulers = {pid: cmd for pid, cmd in remote.items() if "distributed.Scheduler" in cmd}
    assert schedulers and len(schedulers) < len(remote), remote
    S.kill_all(schedulers)
    left = S.wait_no_remote_processes([lab.server], seconds=60)
    took = time.monotonic() - started
    assert left == {}, f"remote workers still running {took:.0f}s after their scheduler: {left}"
    print(f"remote workers stopped {took:.1f}s after their scheduler (death_timeout 5s)")
    api.down(name)


EMBEDDING = textwrap.dedent("""
    import json, sys, time
    from clusterkit.client import get_client
    from clusterkit.schema import SSHProfile
    profile = SSHProfile.model_validate(json.loads(sys.argv[1])).named(sys.argv[2])
    client = get_client(profile)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_killed_notebook_leaves_an_orphan_that_ls_finds_and_down_ends(lab: Lab) -> None:
    from clusterkit import api, state

    name = f"nb-{uuid.uuid4().hex[:6]}"
    data = lab.profile(name).model_dump(mode="json")
    owner = subprocess.Popen(
        [sys.executable, "-c", EMBEDDING, json.dumps(data), name], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        (embedded,) = [r for r in state.records() if r.name.startswith(name)]
        assert embedded.owner == owner.pid and api.list_clusters(orphans=True) == []
    finally:
        owner.kill()  # as a kernel dies: nothing closes the cluster
        owner.wait()
    assert S.remote_processes([lab.server]), "the embedded cluster's remote processes run on"
    orphans = subprocess.run(
        [sys.executable, "-m", "clusterkit", "ls", "--orphans", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert [row["name"] for row in json.loads(orphans.stdout)] == [embedded.name]
    api.down(embedded.name)
    assert S.wait_no_remote_processes([lab.server]) == {}
    assert state.records() == []


def test_project_directory_without_a_shared_disk(lab: Lab, tmp_path: Path) -> None:
    """SSH hosts without NFS (forced copy here, since the test host shares its disk): the
    example project trains from the synced copy and resumes from checkpoint_dir; an objective
    imports its sibling module; an unchanged rerun sends nothing."""
    from clusterkit.client import get_client
    from tests.test_workdir import example_project_on

    client = get_client(lab.profile("ssh-workdir", hosts=["127.0.0.1"] * 2))
    try:
        assert example_project_on(client, tmp_path, copy=True) == {"synced"}
    finally:
        client.close()


# ------------------------------------------------------------------ detached runs


def test_detached_search_attaches_to_the_cluster_from_up(lab: Lab, tmp_path: Path) -> None:
    """`hpo --detach -p NAME` on an ssh cluster from `up` (mutual TLS): its driver attaches by
    name, `runs wait` exits 0, the study holds each trial once, the cluster stays up."""
    import yaml

    from tests.contract import run_detached_contract

    name = f"ssh-runs-{uuid.uuid4().hex[:6]}"
    profile = tmp_path / "runs.yaml"
    data = lab.profile(name, hosts=["127.0.0.1", "127.0.0.1"]).model_dump(mode="json")
    profile.write_text(yaml.safe_dump(data))

    def still_up() -> None:
        assert "Scheduler" in " ".join(S.remote_processes([lab.server]).values())

    run_detached_contract(tmp_path, profile, name, "remote", still_up, timeouts=(150, 180))


def test_a_failed_starts_cleanup_lets_a_login_shell_of_the_cluster_run_its_exit_trap(
    tmp_path: Path,
) -> None:
    """The cleanup after a failed start (``KILL``) ends the cluster's processes, but a shell of
    it gets SIGTERM first: ``pyenv rehash`` in a login shell's ``.bashrc`` holds a lock file it
    removes on exit; killed outright, it left the lock and every later login on the host waited
    60 s for it (CI's SSH tests then timed out connecting)."""
    from clusterkit.backends.ssh.remote import cleanup_command
    from clusterkit.backends.ssh.spec import MARKER_VAR

    cluster_id = f"ck-trap-{uuid.uuid4().hex[:8]}"
    lock = tmp_path / "rehash.lock"
    script = f'trap "rm -f {lock}" EXIT; touch {lock}; while true; do sleep 0.1; done'
    shell = subprocess.Popen(["bash", "-c", script], env={**os.environ, MARKER_VAR: cluster_id})
    try:
        deadline = time.monotonic() + 10
        while not lock.exists():
            assert time.monotonic() < deadline, "the shell did not start"
            time.sleep(0.05)
        subprocess.run(["bash", "-c", cleanup_command(cluster_id, "KILL")], check=True, timeout=30)
        assert shell.wait(timeout=10) != 0
        assert not lock.exists(), "the shell was killed before its EXIT trap ran"
    finally:
        shell.kill()
        shell.wait()
