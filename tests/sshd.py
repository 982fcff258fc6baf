"""Test helpers: a private sshd with generated keys, hosts in netns, remote leftover checks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"

SSHD_CONFIG = """\
Port {port}
ListenAddress {listen}
HostKey {host_key}
PidFile {directory}/sshd-{name}.pid
AuthorizedKeysFile {directory}/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
MaxStartups 200:30:400
MaxSessions 200
LogLevel ERROR
Subsystem sftp internal-sftp
"""


def missing_reason() -> str | None:
    """Why the ssh tier cannot run here (None when it can)."""
    if not os.path.exists(SSHD):
        return f"{SSHD} not found: run scripts/setup/10-ssh.sh (apt-get install openssh-server)"
    if not os.path.isdir("/run/sshd"):
        return "/run/sshd is missing: run scripts/setup/10-ssh.sh"
    return None


@dataclass
class Keys:
    """A host key, a client key authorised to log in, and a second, unauthorised client key."""

    directory: Path
    host_key: Path
    client_key: Path
    stranger_key: Path

    @classmethod
    def generate(cls, directory: Path) -> Keys:
        import asyncssh

        directory.mkdir(parents=True, exist_ok=True)
        paths = {n: directory / n for n in ("host_ed25519", "client_ed25519", "stranger_ed25519")}
        for path in paths.values():
            key = asyncssh.generate_private_key("ssh-ed25519")
            key.write_private_key(str(path))
            key.write_public_key(f"{path}.pub")
            os.chmod(path, 0o600)
        auth = directory / "authorized_keys"
        auth.write_bytes(Path(f"{paths['client_ed25519']}.pub").read_bytes())
        os.chmod(auth, 0o600)
        return cls(
            directory, paths["host_ed25519"], paths["client_ed25519"], paths["stranger_ed25519"]
        )

    def host_public(self, key: Path | None = None) -> str:
        return " ".join(Path(f"{key or self.host_key}.pub").read_text().split()[:2])


@dataclass
class Sshd:
    """One running sshd owned by the test (stopped by PID)."""

    name: str
    listen: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    netns: str | None = None

    @property
    def known_hosts_entry_host(self) -> str:
        return self.listen if self.port == 22 else f"[{self.listen}]:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_sshd(
    keys: Keys,
    name: str,
    listen: str = "127.0.0.1",
    port: int | None = None,
    netns: str | None = None,
) -> Sshd:
    """Start ``sshd -D -e`` (in ``netns`` if given) and wait until it accepts connections."""
    for _attempt in range(5):
        chosen = port or free_port(listen)
        config = keys.directory / f"sshd-{name}.conf"
        config.write_text(
            SSHD_CONFIG.format(
                port=chosen,
                listen=listen,
                host_key=keys.host_key,
                directory=keys.directory,
                name=name,
            )
        )
        log = keys.directory / f"sshd-{name}.log"
        cmd = [SSHD, "-D", "-e", "-f", str(config)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=_daemon_env()
            )
        server = Sshd(name, listen, chosen, proc, log, netns)
        if _wait_listening(server):
            return server
        server.stop()
        if port:
            break
    raise RuntimeError(f"sshd {name} did not start: {log.read_text()[-2000:]}")


def _daemon_env() -> dict[str, str]:
    """sshd outlives single tests: keep the per-test leftover check's token out of its env."""
    return {k: v for k, v in os.environ.items() if k != "CLUSTERKIT_TEST_TOKEN"}


def _wait_listening(server: Sshd, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        if server.netns is None:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((server.listen, server.port), timeout=0.5),
            ):
                return True
        else:
            probe = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    server.netns,
                    "python3",
                    "-c",
                    f"import socket; socket.create_connection({(server.listen, server.port)}, 1)",
                ],
                capture_output=True,
            )
            if probe.returncode == 0:
                return True
        time.sleep(0.05)
    return False


def write_known_hosts(path: Path, keys: Keys, servers: list[Sshd]) -> Path:
    path.write_text("".join(f"{s.known_hosts_entry_host} {keys.host_public()}\n" for s in servers))
    return path


# ------------------------------------------------------------------ remote processes


def remote_processes(servers: list[Sshd]) -> dict[int, str]:
    """Processes started through these sshds (their SSH_CONNECTION names the server's address),
    excluding the sshd processes themselves: pid -> command line."""
    suffixes = [f" {s.listen} {s.port}".encode() for s in servers]
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state == b"Z":
            continue
        for var in environ:
            if var.startswith(b"SSH_CONNECTION=") and any(var.endswith(s) for s in suffixes):
                found[int(entry)] = cmdline[:200]
    return found


def wait_no_remote_processes(servers: list[Sshd], seconds: float = 15.0) -> dict[int, str]:
    """Poll until nothing started through ``servers`` runs; what is left after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = remote_processes(servers)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_all(pids: dict[int, str]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ network namespaces


@dataclass
class Netns:
    """Two namespaces joined by a veth pair whose ends are both named ``ck0``."""

    names: tuple[str, str]
    addresses: tuple[str, str]
    interface: str = "ck0"
    created: list[str] = field(default_factory=list)

    def delete(self) -> None:
        for name in self.created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()


def netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not found: run scripts/setup/10-ssh.sh"
    return None


@contextlib.contextmanager
def two_hosts(subnet: str = "10.231.0") -> Iterator[Netns]:
    """Create ck-a/ck-b style namespaces (unique per process), delete them afterwards."""
    tag = f"{os.getpid() % 100000}"
    a, b = f"cka{tag}", f"ckb{tag}"
    va, vb = f"cva{tag}", f"cvb{tag}"
    net = Netns((a, b), (f"{subnet}.1", f"{subnet}.2"))
    steps = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
        ["ip", "link", "set", va, "netns", a],
        ["ip", "link", "set", vb, "netns", b],
        ["ip", "-n", a, "link", "set", va, "name", net.interface],
        ["ip", "-n", b, "link", "set", vb, "name", net.interface],
        ["ip", "-n", a, "addr", "add", f"{net.addresses[0]}/24", "dev", net.interface],
        ["ip", "-n", b, "addr", "add", f"{net.addresses[1]}/24", "dev", net.interface],
    ]
    for ns in (a, b):
        steps += [
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "set", net.interface, "up"],
        ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
            if step[:3] == ["ip", "netns", "add"]:
                net.created.append(step[3])
        yield net
    finally:
        net.delete()
        subprocess.run(["ip", "link", "del", va], capture_output=True)  # if never moved
