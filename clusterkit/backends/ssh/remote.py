"""What clusterkit itself does on remote hosts over asyncssh: ship TLS files, probe, clean up."""

from __future__ import annotations

import asyncio
import concurrent.futures
import shlex
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from clusterkit.backends.ssh.spec import MARKER_VAR, REMOTE_ROOT

T = TypeVar("T")

#: Lines of remote stderr kept as evidence.
TAIL = 20


def run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from sync code, even when called inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def describe_error(error: BaseException) -> str:
    """A one-line reason for an asyncssh/OS failure, naming what the user can fix."""
    import asyncssh

    if isinstance(error, asyncssh.HostKeyNotVerifiable):
        return f"host key not verifiable ({error.reason}): changed or unknown host key"
    if isinstance(error, asyncssh.PermissionDenied):
        return f"login refused ({error.reason}): check user and identity_files"
    if isinstance(error, asyncssh.DisconnectError):
        return f"disconnected: {error.reason}"
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "timed out connecting"
    if isinstance(error, OSError) and error.filename:  # a key or known_hosts file, not the host
        return f"cannot read {error.filename}: {error.strerror or error}"
    if isinstance(error, OSError):
        return f"unreachable: {error.strerror or error}"
    return f"{type(error).__name__}: {error}"


async def _connect(host: str, options: dict[str, Any]) -> Any:
    import asyncssh

    return await asyncssh.connect(host, **options)


@dataclass
class Result:
    """Outcome of one remote command (or of failing to run it)."""

    host: str
    ok: bool
    stdout: str = ""
    stderr: str = ""
    reason: str = ""

    def tail(self, lines: int = TAIL) -> list[str]:
        text = self.stderr or self.reason
        return [line for line in text.splitlines() if line.strip()][-lines:]


async def run(host: str, options: dict[str, Any], command: str, timeout: float) -> Result:
    """Run ``command`` on ``host``; a failure to connect is a Result too, with its reason."""

    async def _run() -> Any:
        async with await _connect(host, options) as conn:
            return await conn.run(command, check=False)

    try:
        done = await asyncio.wait_for(_run(), timeout)
    except Exception as error:
        return Result(host, False, reason=describe_error(error))
    stdout = str(done.stdout or "")
    stderr = str(done.stderr or "")
    reason = "" if done.exit_status == 0 else f"exit status {done.exit_status}"
    return Result(host, done.exit_status == 0, stdout, stderr, reason)


async def gather_hosts(hosts: Sequence[str], call: Callable[[str], Awaitable[T]]) -> list[T]:
    return list(await asyncio.gather(*(call(h) for h in hosts)))


async def upload_tls(
    host: str, options: dict[str, Any], cluster_id: str, files: Sequence[tuple[str, str]]
) -> str:
    """Copy the cluster's TLS files, (name, local path), into a private directory (0700,
    files 0600); its path."""
    async with await _connect(host, options) as conn, conn.start_sftp_client() as sftp:
        home = await sftp.realpath(".")
        directory = f"{home}/{REMOTE_ROOT}/{cluster_id}"
        await sftp.makedirs(directory, exist_ok=True)
        for part in (f"{home}/.clusterkit", f"{home}/{REMOTE_ROOT}", directory):
            await sftp.chmod(part, 0o700)
        for name, local in files:
            remote = f"{directory}/{name}"
            # create the file private before any byte is written
            async with sftp.open(remote, "wb", attrs=_private_attrs()) as handle:
                with open(local, "rb") as source:
                    await handle.write(source.read())
            await sftp.chmod(remote, 0o600)
        return directory


def _private_attrs() -> Any:
    import asyncssh

    return asyncssh.SFTPAttrs(permissions=0o600)


def cleanup_command(cluster_id: str, signal: str = "TERM") -> str:
    """Shell: signal every process of this cluster (found by its marker), remove its files.

    ``KILL`` sends SIGTERM first and SIGKILL a second later to what is left: a login shell of
    the cluster's (sshd runs the user's ``.bashrc``) killed outright in ``pyenv rehash`` left its
    lock behind, and every later login on the host then waited 60 s for it."""
    marker = shlex.quote(f"{MARKER_VAR}={cluster_id}")
    directory = shlex.quote(f"{REMOTE_ROOT}/{cluster_id}")
    signals = ["TERM", "KILL"] if signal == "KILL" else [signal]
    rounds = [
        "for p in /proc/[0-9]*; do "
        f"if tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qxF {marker}; then "
        f"kill -{name} ${{p#/proc/}} 2>/dev/null; fi; done; "
        for name in signals
    ]
    return "sleep 1; ".join(rounds) + f"cd && rm -rf {directory}"


async def cleanup(
    hosts: Sequence[str], options: dict[str, Any], cluster_id: str, signal: str = "TERM"
) -> list[Result]:
    """Stop what is left of the cluster on every host and remove its private directory."""
    command = cleanup_command(cluster_id, signal)
    return await gather_hosts(hosts, lambda h: run(h, options, command, timeout=30))


def probe_command(python: str, preload: Sequence[str]) -> str:
    """Shell: report versions and GPU count with the remote python; import the preloads."""
    imports = "".join(f"import {m}\n" for m in preload if _is_module_name(m))
    script = (
        "import json, shutil, subprocess, sys\n"
        "import dask, distributed\n"
        f"{imports}"
        "gpus = 0\n"
        "if shutil.which('nvidia-smi'):\n"
        "    out = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True)\n"
        "    gpus = sum(1 for line in out.stdout.splitlines() if line.startswith('GPU '))\n"
        "print(json.dumps({'python': '.'.join(map(str, sys.version_info[:3])),"
        " 'dask': dask.__version__, 'distributed': distributed.__version__, 'gpus': gpus}))\n"
    )
    return f"{python} -c {shlex.quote(script)}"


def _is_module_name(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def connect_back_command(python: str, address: str) -> str:
    """Shell: open a TCP connection from the host to the scheduler's host:port."""
    host_port = address.split("://", 1)[-1]
    host, _, port = host_port.rpartition(":")
    script = (
        "import socket, sys\n"
        f"socket.create_connection(({host.strip('[]')!r}, {int(port)}), timeout=5).close()\n"
    )
    return f"{python} -c {shlex.quote(script)}"
