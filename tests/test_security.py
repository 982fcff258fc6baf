"""Tests that try to get in: a client without the cluster's certificates, run by a second Unix
user of this machine or from another host, must not run code on a default cluster of any
backend; the owner's ``get_client(NAME)`` must; nobody else can read the keys.

The default protocol is mutual TLS (a fresh CA per cluster, a key for each of scheduler,
workers and client). Against a plain-TCP default, the probe below runs ``os.getuid()`` as the
cluster's owner, and each "cannot get in" test fails with the probe's own line saying it got
in (the key test: the record names no key); test_probe_gets_in_... shows the probe can.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from clusterkit import api, state
from clusterkit.client import get_client
from clusterkit.security import SERVER_NAMES
from clusterkit.state import ClusterRecord
from tests import slurm as SL
from tests import sshd as S
from tests.test_faults import (  # noqa: F401 - fixture
    SECOND_USER,
    User,
    _ancestors_closed_to_others,
    second_user,
)
from tests.test_kubernetes import Harness, clean, k8s, write_profile  # noqa: F401
from tests.test_slurm import empty_queue_after, profile_file  # noqa: F401

CLI = [sys.executable, "-m", "clusterkit"]

#: the probe's exit status when every address it tried refused it
REFUSED = 3
#: seconds the probe's Client waits for a scheduler that does not let it in
PROBE_TIMEOUT = 5

#: A client with no certificate of the cluster's CA. For a tls:// address it still speaks
#: TLS (checking no server certificate, presenting none of its own), which is what an
#: attacker who knows the address can do; for tcp:// it speaks plain TCP. It prints one line
#: per address and exits REFUSED only when none of them ran its task.
PROBE = textwrap.dedent(f"""
    import os, ssl, sys
    from distributed import Client, Security

    class NoCertificate(Security):
        def get_connection_args(self, role):
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return {{"ssl_context": context, "require_encryption": False,
                    "extra_conn_args": {{}}}}

    got_in = False
    for address in sys.argv[1:]:
        security = NoCertificate() if address.startswith("tls://") else None
        try:
            with Client(address, security=security, timeout={PROBE_TIMEOUT}) as client:
                uid = client.submit(os.getuid, pure=False).result(timeout=30)
        except Exception as error:
            print(f"{{address}} refused: {{type(error).__name__}}: {{error}}"[:300], flush=True)
        else:
            got_in = True
            print(f"{{address}} GOT IN: os.getuid() ran on the cluster and gave {{uid}}",
                  flush=True)
    sys.exit(0 if got_in else {REFUSED})
""")


def both_schemes(address: str) -> list[str]:
    """The scheduler's host:port as a plain-TCP and as a TLS address, whatever it advertises."""
    where = address.split("://", 1)[-1]
    return [f"tcp://{where}", f"tls://{where}"]


def assert_refused(probe: subprocess.CompletedProcess[str], who: str) -> None:
    """The probe's status and its own lines say every address refused it."""
    said = (probe.stdout + probe.stderr[-2000:]).strip()
    assert probe.returncode == REFUSED, f"{who} was not refused (exit {probe.returncode}):\n{said}"
    lines = probe.stdout.splitlines()
    assert len(lines) == 2 and all(" refused: " in line for line in lines), said


def probe_here(
    addresses: list[str], prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """The probe as this user (root), optionally under ``prefix`` (e.g. ``ip netns exec B``)."""
    return subprocess.run(
        [*prefix, sys.executable, "-c", PROBE, *addresses],
        capture_output=True,
        text=True,
        timeout=120,
    )


def owner_runs_a_task(name: str) -> None:
    with get_client(name) as client:
        assert client.submit(os.getuid, pure=False).result(timeout=60) == os.getuid()


def cli(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh process (under ``prefix``, e.g. ``ip netns exec A``)."""
    return subprocess.run([*prefix, *CLI, *args], capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------ local: a second Unix user


@dataclass
class CliCluster:
    """A default ``local`` cluster that ``clusterkit up local --name NAME`` started."""

    name: str
    record: ClusterRecord
    state_dir: Path  # made by clusterkit itself, inside a directory others may enter


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliCluster]:
    """One default local cluster for the module's second-user tests (the bundled profile,
    dashboard and all), with a state directory clusterkit creates itself."""
    opened = tmp_path_factory.mktemp("open")
    opened.chmod(0o755)
    state_root = opened / "state"
    name = f"sec-{uuid.uuid4().hex[:6]}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CLUSTERKIT_STATE_DIR", str(state_root))
        up = cli("up", "local", "--name", name)
        assert up.returncode == 0, up.stderr
        try:
            record = state.read_record(name)
            assert record is not None and record.address, up.stdout
            yield CliCluster(name, record, state_root)
        finally:
            down = cli("down", name)
        assert down.returncode == 0, down.stderr


@pytest.fixture
def at(cli_cluster: CliCluster, monkeypatch: pytest.MonkeyPatch) -> CliCluster:
    """The module's cluster, with this test's state directory set to the cluster's."""
    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(cli_cluster.state_dir))
    return cli_cluster


@pytest.mark.local
def test_second_user_cannot_run_a_task_on_a_default_cluster_from_up(
    at: CliCluster,
    second_user: User,  # noqa: F811
) -> None:
    probe = second_user.run("-c", PROBE, *both_schemes(at.record.address))
    assert_refused(probe, f"user {second_user.name} (a client without certificates)")
    owner_runs_a_task(at.name)


@pytest.mark.local
def test_second_user_can_read_no_key_of_the_cluster(
    at: CliCluster,
    second_user: User,  # noqa: F811
) -> None:
    """Every key clusterkit wrote is 0600 in 0700 directories, and the second user, let into
    the directory that holds the state directory, opens none of them."""
    key_file = at.record.security.get("key_file")
    assert key_file, f"the record names no client key: security = {at.record.security}"
    assert Path(key_file).is_relative_to(at.state_dir), key_file
    keys: list[Path] = []
    for directory, _dirs, files in os.walk(at.state_dir):
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        assert mode == 0o700, f"{directory} is {mode:o}"
        for file in files:
            path = Path(directory) / file
            if file.endswith(".pem"):
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{path} is not 0600"
            if "key" in file and file.endswith(".pem"):
                keys.append(path)
    assert Path(key_file) in keys, keys
    assert len(keys) >= 3, f"scheduler, workers and client need a key each; found {keys}"
    granted = _ancestors_closed_to_others([at.state_dir.parent])
    try:
        for directory in granted:  # as a home directory (0755) usually is
            subprocess.run(["setfacl", "-m", f"u:{SECOND_USER}:x", str(directory)], check=True)
        reader = second_user.run("-c", READ_EACH, *map(str, keys))
    finally:
        for directory in granted:
            subprocess.run(
                ["setfacl", "-x", f"u:{SECOND_USER}", str(directory)], capture_output=True
            )
    assert reader.returncode == 0, reader.stderr
    assert reader.stdout.split() == ["denied"] * len(keys), reader.stdout


READ_EACH = textwrap.dedent("""
    import sys
    for path in sys.argv[1:]:
        try:
            open(path, "rb").read()
        except PermissionError:
            print("denied")
        else:
            print("READ", path)
""")

#: The owner's notebook: an embedded cluster from ``get_client()`` (argv: a profile, or none
#: for the default); prints the scheduler's address and the uid its task ran as, then waits.
#: clusterkit's log goes to stderr from INFO up, so a notice is seen whatever its level.
EMBEDDED = textwrap.dedent("""
    import logging, os, sys
    from clusterkit import get_client
    log = logging.getLogger("clusterkit")
    log.addHandler(logging.StreamHandler())
    log.setLevel(logging.INFO)
    client = get_client(*sys.argv[1:])
    print(client.scheduler.address, flush=True)
    print(client.submit(os.getuid, pure=False).result(timeout=60), flush=True)
    sys.stdin.readline()
    client.close()
""")


@contextlib.contextmanager
def embedded(log: Path, *profile: str) -> Iterator[str]:
    """An owner's process holding an embedded cluster, its stderr in ``log``: yields the
    scheduler's address once the owner's own task ran (as the owner)."""
    with open(log, "w") as errors:
        owner = subprocess.Popen(
            [sys.executable, "-c", EMBEDDED, *profile],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
    assert owner.stdin is not None and owner.stdout is not None
    try:
        address = owner.stdout.readline().strip()
        uid = owner.stdout.readline().strip()
        if not address or not uid:
            owner.kill()
            owner.wait()
            pytest.fail(f"the embedded cluster did not start:\n{log.read_text()[-3000:]}")
        assert int(uid) == os.getuid(), "the owner's own task ran as someone else"
        yield address
    finally:
        if owner.poll() is None:
            owner.stdin.write("\n")
            owner.stdin.close()
            try:
                owner.wait(60)
            except subprocess.TimeoutExpired:
                owner.kill()
                owner.wait()


@pytest.mark.local
def test_second_user_cannot_run_a_task_on_an_embedded_default_cluster(
    second_user: User,  # noqa: F811 - fixture
    tmp_path: Path,
) -> None:
    with embedded(tmp_path / "owner.log") as address:
        probe = second_user.run("-c", PROBE, *both_schemes(address))
    assert_refused(probe, f"user {second_user.name} (a client without certificates)")


@pytest.mark.local
def test_explicit_tcp_still_works_and_says_who_can_run_code(tmp_path: Path) -> None:
    """`protocol: tcp` in a profile: the owner's plain client runs tasks, and both `up` (on
    stderr) and an embedded `get_client()` (in its log) say in one line what that means."""
    profile = tmp_path / "plain.yaml"
    profile.write_text("backend: local\nprotocol: tcp\nworkers: 1\nscheduler: {dashboard: false}\n")
    up = cli("up", str(profile))
    assert up.returncode == 0, up.stderr
    try:
        record = state.read_record("plain")
        assert record is not None and record.address.startswith("tcp://"), record
        owner = probe_here([record.address, record.address])
        assert owner.returncode == 0 and "GOT IN" in owner.stdout, owner.stdout + owner.stderr
        owner_runs_a_task("plain")
    finally:
        down = cli("down", "plain")
    assert down.returncode == 0, down.stderr
    notice = [line for line in up.stderr.splitlines() if "protocol tcp" in line]
    assert len(notice) == 1 and "run code as you" in notice[0], up.stderr
    with embedded(tmp_path / "owner.log", str(profile)) as address:
        assert address.startswith("tcp://")
    logged = (tmp_path / "owner.log").read_text()
    notice = [line for line in logged.splitlines() if "protocol tcp" in line]
    assert len(notice) == 1 and "run code as you" in notice[0], logged[-3000:]


# ------------------------------------------------------------------ ssh: another host


@pytest.mark.ssh
@pytest.mark.timeout(300)
def test_default_ssh_cluster_refuses_a_client_on_another_host(tmp_path: Path) -> None:
    """The cluster's host and a stranger's host in two network namespaces: `clusterkit up`
    runs on A (one sshd there, scheduler and worker on A); the probe runs on B."""
    reason = S.missing_reason() or S.netns_reason()
    if reason:
        pytest.skip(reason)
    keys = S.Keys.generate(tmp_path / "keys")
    with S.two_hosts("10.232.0") as net:
        on_a, on_b = (("ip", "netns", "exec", ns) for ns in net.names)
        server = S.start_sshd(keys, "sec", listen=net.addresses[0], port=22, netns=net.names[0])
        try:
            profile = tmp_path / "remote.yaml"
            profile.write_text(
                yaml.safe_dump(
                    {
                        "backend": "ssh",
                        "hosts": [net.addresses[0]],
                        "user": "root",
                        "identity_files": [str(keys.client_key)],
                        "known_hosts": str(S.write_known_hosts(tmp_path / "known", keys, [server])),
                        "remote_python": sys.executable,
                        "start_timeout": 60,
                        "scheduler": {"dashboard": False},
                    }
                )
            )
            up = cli("up", str(profile), prefix=on_a)
            assert up.returncode == 0, up.stderr
            try:
                record = state.read_record("remote")
                assert record is not None
                assert record.address.split("://")[1].startswith(f"{net.addresses[0]}:")
                probe = probe_here(both_schemes(record.address), prefix=on_b)
                owner = subprocess.run(
                    [*on_a, sys.executable, "-c", OWNER_ATTACHES, "remote"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert owner.returncode == 0, owner.stderr[-3000:]
                assert owner.stdout.split() == [str(os.getuid())], owner.stdout
            finally:
                down = cli("down", "remote", prefix=on_a)
            assert down.returncode == 0, down.stderr
            assert_refused(probe, f"a client on {net.addresses[1]} without certificates")
            left = S.wait_no_remote_processes([server])
            S.kill_all(left)
            assert not left, f"remote processes left running: {left}"
        finally:
            server.stop()


OWNER_ATTACHES = textwrap.dedent("""
    import os, sys
    from clusterkit import get_client
    with get_client(sys.argv[1]) as client:
        print(client.submit(os.getuid, pure=False).result(timeout=60))
""")


# ------------------------------------------------------------------ slurm, kubernetes


def assert_up_cluster_refuses_strangers(profile: Path) -> None:
    """`up` the profile's default cluster: a client without its certificates is refused at
    the recorded address (for Kubernetes, the port-forward on 127.0.0.1), its owner is not."""
    record = api.up(profile)
    try:
        assert record.address.split("://")[1].startswith("127.0.0.1:"), record.address
        probe = probe_here(both_schemes(record.address))
        owner_runs_a_task(record.name)
    finally:
        api.down(record.name)
    assert_refused(probe, "a client without certificates")


@pytest.mark.slurm
def test_default_slurm_cluster_refuses_a_client_without_certificates(
    slurm: SL.Slurm, tmp_path: Path
) -> None:
    assert_up_cluster_refuses_strangers(profile_file(tmp_path, "sec-slurm"))


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_default_kubernetes_cluster_refuses_a_client_without_certificates(
    clean: Harness,  # noqa: F811 - fixture
    tmp_path: Path,
) -> None:
    """The probe dials the scheduler where the test's port-forward exposes it (the record's
    address on 127.0.0.1)."""
    assert_up_cluster_refuses_strangers(write_profile(tmp_path, "sec-k8s", workers=1))


@pytest.mark.local
def test_probe_gets_in_where_nothing_guards_the_door() -> None:
    """The probe itself: against a raw plain-TCP cluster it reports getting in (so a
    'refused' above is the cluster's doing, not a broken probe)."""
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        processes=False,
        protocol="tcp://",
        host="127.0.0.1",
        dashboard_address=None,
    ) as cluster:
        probe = probe_here(both_schemes(cluster.scheduler_address))
    assert probe.returncode == 0, probe.stdout + probe.stderr[-2000:]
    tcp_line, tls_line = probe.stdout.splitlines()
    assert f"GOT IN: os.getuid() ran on the cluster and gave {os.getuid()}" in tcp_line
    assert " refused: " in tls_line  # TLS spoken to a plain-TCP server


# ------------------------------------------------------------------ unit: certificates, notices


@pytest.mark.unit
def test_each_party_has_its_own_key_signed_by_a_ca_whose_key_is_never_written(
    tmp_path: Path,
) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from clusterkit.security import ROLE_FILES, generate_tls

    security = generate_tls(tmp_path / "certs", ["node1"])
    files = sorted(p.name for p in (tmp_path / "certs").iterdir())
    assert files == sorted(["ca.pem", *(n for pair in ROLE_FILES.values() for n in pair)])
    ca = x509.load_pem_x509_certificate((tmp_path / "certs/ca.pem").read_bytes())
    keys = set()
    for role, (cert_name, key_name) in ROLE_FILES.items():
        cert = x509.load_pem_x509_certificate((tmp_path / "certs" / cert_name).read_bytes())
        cert.verify_directly_issued_by(ca)
        keys.add((tmp_path / "certs" / key_name).read_bytes())
        usage = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        server = ExtendedKeyUsageOID.SERVER_AUTH in usage
        assert server == (role != "client"), f"{role}: only scheduler and workers serve"
        assert security.pair(role) == tuple(str(tmp_path / "certs" / n) for n in ROLE_FILES[role])
    assert len(keys) == 3, "every party has its own key"
    assert not isinstance(ca.public_key(), type(None)) and isinstance(
        ca.public_key(), ec.EllipticCurvePublicKey
    )
    # no file holds a key that signs for the CA: the only private keys are the three parties'
    assert sum(b"PRIVATE KEY" in p.read_bytes() for p in (tmp_path / "certs").iterdir()) == 3
    assert security.client_only().roles == {}
    assert [name for name, _ in security.server_files()] == list(SERVER_NAMES)


@pytest.mark.unit
def test_plain_protocols_say_who_can_run_code_and_tls_says_nothing() -> None:
    from clusterkit.security import exposure

    assert exposure("tls", "tls://127.0.0.1:1") is None
    local = exposure("tcp", "tcp://127.0.0.1:8786")
    assert local is not None and "every user of this machine" in local
    remote = exposure("ucx", "ucx://10.0.0.5:8786")
    assert remote is not None and "anyone who can reach ucx://10.0.0.5:8786" in remote
    assert "neither encrypt nor authenticate" in remote


@pytest.mark.unit
def test_profiles_show_names_who_can_connect_to_a_tcp_profile(tmp_path: Path) -> None:
    (tmp_path / "open.yaml").write_text("backend: local\nprotocol: tcp\n")
    (tmp_path / "closed.yaml").write_text("backend: local\n")
    shown = cli("profiles", "show", str(tmp_path / "open.yaml"))
    assert shown.returncode == 0 and "protocol tcp" in shown.stderr
    assert yaml.safe_load(shown.stdout)["protocol"] == "tcp"  # stdout stays data
    closed = cli("profiles", "show", str(tmp_path / "closed.yaml"))
    assert closed.returncode == 0 and closed.stderr == ""
    assert yaml.safe_load(closed.stdout)["protocol"] == "tls"


@pytest.mark.unit
def test_address_profiles_refuse_plaintext_to_another_machine(tmp_path: Path) -> None:
    from clusterkit.errors import BadInput, ProfileError
    from clusterkit.profiles import load_profile

    (tmp_path / "far.yaml").write_text("backend: address\naddress: tcp://10.9.8.7:8786\n")
    with pytest.raises(BadInput, match="refusing to attach in plaintext"):
        get_client(str(tmp_path / "far.yaml"))  # refused before any packet leaves
    (tmp_path / "tlsless.yaml").write_text("backend: address\naddress: tls://127.0.0.1:1\n")
    with pytest.raises(ProfileError, match="needs the client's `tls:` files"):
        load_profile(tmp_path / "tlsless.yaml")
    ok = "backend: address\naddress: tcp://10.9.8.7:8786\nallow_plaintext: true\n"
    (tmp_path / "mine.yaml").write_text(ok)
    assert load_profile(tmp_path / "mine.yaml").protocol == "tcp"  # from the address


@pytest.mark.unit
def test_dashboard_binds_loopback_and_prints_the_tunnel_for_a_remote_one() -> None:
    from clusterkit.backends.options import dashboard_address
    from clusterkit.monitor import dashboard_tunnel

    assert dashboard_address(None, 0) == "127.0.0.1:0"  # never Dask's every-interface ":0"
    far = ClusterRecord(
        name="c",
        backend="slurm",
        profile="p",
        profile_source=None,
        digest="",
        address="",
        dashboard="http://127.0.0.1:8790/status",
        pid=1,
        security={},
        min_workers=0,
        host="login7",
    )
    assert dashboard_tunnel(far) == (
        "ssh -N -L 8790:127.0.0.1:8790 login7",
        "http://localhost:8790/status",
    )
    far.host = state.HOST
    assert dashboard_tunnel(far) is None
    pods = ClusterRecord(
        name="k",
        backend="kubernetes",
        profile="p",
        profile_source=None,
        digest="",
        address="",
        dashboard="http://localhost:40001/status",
        pid=None,
        security={},
        min_workers=0,
        extra={"name": "k", "namespace": "research"},
    )
    command, link = dashboard_tunnel(pods) or ("", "")
    assert command == "kubectl port-forward -n research service/k-scheduler 40001:8787"
    assert link == "http://localhost:40001/status"
