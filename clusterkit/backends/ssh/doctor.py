"""Doctor checks of an ssh profile: login, versions, GPUs, and reaching the scheduler per host."""

from __future__ import annotations

import json
import shlex
import sys
from typing import TYPE_CHECKING

from clusterkit.backends.base import Check
from clusterkit.backends.ssh import remote as ssh_remote
from clusterkit.backends.ssh import spec as ssh_spec

if TYPE_CHECKING:
    from clusterkit.schema import SSHProfile
    from clusterkit.security import ClusterSecurity


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
        listener = await conn.create_process(f"{plan.remote_python} -c {shlex.quote(script)}")
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
