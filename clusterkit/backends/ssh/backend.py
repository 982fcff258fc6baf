"""The ssh backend: a scheduler and workers on other machines, started over asyncssh."""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from clusterkit.backends.base import Capability, Check, Requirement
from clusterkit.backends.ssh import remote as ssh_remote
from clusterkit.backends.ssh import spec as ssh_spec
from clusterkit.errors import ClusterStartError
from clusterkit.schema import SSHProfile

if TYPE_CHECKING:
    from distributed.deploy.spec import SpecCluster

    from clusterkit.security import ClusterSecurity

Profile = SSHProfile
NAME = "ssh"
CAPABILITIES = frozenset({Capability.GPU, Capability.UCX, Capability.TLS, Capability.SCALE})
REQUIRES = [Requirement("asyncssh", "asyncssh", "ssh")]


def render(profile: SSHProfile, security: ClusterSecurity) -> str:
    """The commands that will run on each host, with the SSH settings used to reach them."""
    plan = ssh_spec.plan(profile, security)
    plan.env[ssh_spec.MARKER_VAR] = "<cluster-id>"
    if security.tls:
        placeholder = f"$HOME/{ssh_spec.REMOTE_ROOT}/<cluster-id>"
        plan.remote_dirs = {host: placeholder for host in plan.hosts}
    opts = plan.connect_options
    known = (
        "NOT CHECKED"
        if opts.get("known_hosts", "") is None
        else opts.get("known_hosts", "~/.ssh/known_hosts")
    )
    keys = ", ".join(opts.get("client_keys", [])) or "<ssh agent/default>"
    lines = [
        f"# ssh profile '{profile.name}': scheduler on {plan.scheduler_host}; "
        f"{profile.workers_per_host} {plan.worker_class} per host on {', '.join(profile.hosts)}",
        f"# ssh: port {opts['port']}, user {opts.get('username', '<current user>')}, "
        f"host keys: {known}, keys: {keys}",
    ]
    if security.tls:
        lines.append(
            f"# tls: ca.pem, cert.pem, key.pem copied over SFTP to {placeholder} (0700, files "
            "0600) on each host, removed when the cluster closes"
        )
    for host, commands in plan.commands().items():
        lines.append(f"[{host}]")
        lines.extend(f"  {command}" for command in commands)
    return "\n".join(lines) + "\n"


def create_cluster(profile: SSHProfile, security: ClusterSecurity) -> SpecCluster:
    """Start the scheduler and workers over SSH; on failure, leave nothing behind and say where."""
    from clusterkit.backends.ssh.cluster import ClusterkitSSHCluster, StartLog

    start_log = StartLog(deadline=time.monotonic() + profile.start_timeout)
    plan = ssh_spec.plan(profile, security, timeout=profile.start_timeout)
    cluster_id = uuid.uuid4().hex[:16]
    plan.env[ssh_spec.MARKER_VAR] = cluster_id
    try:
        if security.tls:
            plan.remote_dirs = _upload_tls(plan, cluster_id, security)
        return ClusterkitSSHCluster(plan, cluster_id, start_log, security=security.distributed())
    except Exception as error:
        ssh_remote.run_sync(
            lambda: ssh_remote.cleanup(plan.hosts, plan.connect_options, cluster_id, "KILL")
        )
        if isinstance(error, ClusterStartError):
            raise
        raise _start_error(plan, start_log, error) from error


def _upload_tls(plan: ssh_spec.Plan, cluster_id: str, security: ClusterSecurity) -> dict[str, str]:
    async def one(host: str) -> tuple[str, str | BaseException]:
        try:
            files = security.files()
            return host, await ssh_remote.upload_tls(host, plan.connect_options, cluster_id, files)
        except Exception as error:
            return host, error

    results = ssh_remote.run_sync(lambda: ssh_remote.gather_hosts(plan.hosts, one))
    for host, outcome in results:
        if isinstance(outcome, BaseException):
            reason = ssh_remote.describe_error(outcome)
            raise ClusterStartError(
                f"could not copy the TLS certificates to {host}: {reason}",
                component=f"ssh {host}",
                evidence=[reason],
            )
    return {host: str(directory) for host, directory in results}


def _start_error(plan: ssh_spec.Plan, start_log: Any, error: BaseException) -> ClusterStartError:
    if start_log.failures:
        host, role, reason = start_log.failures[0]
    else:
        host, role, reason = plan.scheduler_host, "cluster", str(error)
    lines = list(start_log.lines.get(host, []))[-ssh_remote.TAIL :] or [reason]
    return ClusterStartError(
        f"{role} on {host} did not start: {reason}",
        component=f"ssh {host}",
        evidence=lines,
        hint="run `clusterkit doctor` on this profile",
    )


def evidence(cluster: Any, profile: SSHProfile) -> list[str]:
    """Remote stderr tails captured while the cluster started."""
    return cluster.evidence() if hasattr(cluster, "evidence") else []


def doctor(profile: SSHProfile, security: ClusterSecurity) -> list[Check]:
    """Per host: login, Python and Dask versions equal to ours, GPUs, reaching the scheduler."""
    return ssh_remote.run_sync(lambda: _doctor(profile, security))


async def _doctor(profile: SSHProfile, security: ClusterSecurity) -> list[Check]:
    import dask
    import distributed

    plan = ssh_spec.plan(profile, security)
    opts = plan.connect_options
    python = plan.remote_python
    mine = {
        "python": ".".join(map(str, sys.version_info[:3])),
        "dask": dask.__version__,
        "distributed": distributed.__version__,
    }
    command = ssh_remote.probe_command(python, profile.preload)
    probes = await ssh_remote.gather_hosts(
        plan.hosts, lambda h: ssh_remote.run(h, opts, command, profile.start_timeout)
    )
    checks: list[Check] = []
    for probe in probes:
        host = probe.host
        if not probe.ok and probe.stdout == "" and "exit status" not in probe.reason:
            checks.append(Check(f"{host}: login", False, probe.reason, "check hosts, user, keys"))
            continue
        checks.append(Check(f"{host}: login", True, f"port {opts['port']}"))
        if not probe.ok:
            tail = " | ".join(probe.tail(3))
            checks.append(
                Check(f"{host}: python", False, f"{python}: {tail}", "set remote_python or install")
            )
            continue
        theirs = json.loads(probe.stdout.strip().splitlines()[-1])
        for key, value in mine.items():
            same = theirs[key] == value
            checks.append(
                Check(
                    f"{host}: {key}",
                    same,
                    f"{theirs[key]} (client {value})",
                    "" if same else f"install {key} {value} on {host}",
                )
            )
        if profile.worker.gpus:
            enough = theirs["gpus"] >= profile.worker.gpus
            checks.append(
                Check(
                    f"{host}: gpus",
                    enough,
                    f"{theirs['gpus']} (profile wants {profile.worker.gpus})",
                    "" if enough else "lower worker.gpus",
                )
            )
    if all(c.ok for c in checks):
        checks.extend(await _reach_scheduler(plan, profile))
    return checks


async def _reach_scheduler(plan: ssh_spec.Plan, profile: SSHProfile) -> list[Check]:
    """Listen on the scheduler's bind address on its host; connect to it from every host."""
    import asyncssh

    bind = plan.scheduler_options.get("host") or "0.0.0.0"
    port = profile.scheduler.port
    script = (
        "import socket, sys\n"
        f"s = socket.create_server(({bind!r}, {port}))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "s.settimeout(1)\n"
        "while sys.stdin.readline():\n"
        "    pass\n"
    )
    conn = await asyncssh.connect(plan.scheduler_host, **plan.connect_options)
    async with conn:
        listener = await conn.create_process(f"{plan.remote_python} -c {_quote(script)}")
        line = await listener.stdout.readline()
        if not line.strip():
            err = (await listener.stderr.read()).strip().splitlines()[-1:]
            return [
                Check(
                    f"{plan.scheduler_host}: scheduler port",
                    False,
                    " ".join(err),
                    "free scheduler.port or fix scheduler.host",
                )
            ]
        address = f"{bind}:{int(line)}"
        command = ssh_remote.connect_back_command(plan.remote_python, address)
        results = await ssh_remote.gather_hosts(
            plan.hosts, lambda h: ssh_remote.run(h, plan.connect_options, command, 20)
        )
        listener.stdin.write_eof()
        listener.close()
    return [
        Check(
            f"{r.host}: reaches scheduler",
            r.ok,
            f"{address}" + ("" if r.ok else f": {' | '.join(r.tail(2))}"),
            "" if r.ok else "set scheduler.host/interface",
        )
        for r in results
    ]


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


BACKEND = sys.modules[__name__]
