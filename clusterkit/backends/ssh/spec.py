"""Pure translation of an ssh profile into SSH connection options and remote process specs."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shlex
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clusterkit import webauth
from clusterkit.backends import options
from clusterkit.schema import cuda
from clusterkit.security import server_tls_env

if TYPE_CHECKING:
    from clusterkit.schema import SSHProfile
    from clusterkit.security import ClusterSecurity

logger = logging.getLogger(__name__)

#: Environment variable that marks every remote process of one cluster (cleanup finds them by it).
MARKER_VAR = "CLUSTERKIT_CLUSTER"
#: Where TLS files go on each host, under the remote user's home.
REMOTE_ROOT = ".clusterkit/run"

WORKER_CLASS = "distributed.Nanny"
CUDA_WORKER_CLASS = "dask_cuda.CUDAWorker"


@dataclass
class Plan:
    """Everything needed to start one cluster: who runs what, with which options."""

    scheduler_host: str
    worker_hosts: list[str]
    connect_options: dict[str, Any]
    scheduler_options: dict[str, Any]
    worker_options: dict[str, dict[str, Any]]  # per worker host
    worker_class: str
    remote_python: str
    env: dict[str, str] = field(default_factory=dict)
    #: per host, the absolute private directory holding the cluster's TLS files and web secret
    remote_dirs: dict[str, str] = field(default_factory=dict)
    tls: bool = False

    @property
    def hosts(self) -> list[str]:
        """Every distinct host, scheduler first."""
        return list(dict.fromkeys([self.scheduler_host, *self.worker_hosts]))

    def remote_env(self, host: str) -> dict[str, str]:
        """Environment of the remote processes on ``host``: profile, protocol, TLS settings."""
        env = dict(self.env)
        directory = self.remote_dirs.get(host)
        if directory is not None and self.tls:
            env.update(server_tls_env(directory))
        if self.gated:
            env.update(webauth.remote_env(directory))
        return env

    @property
    def gated(self) -> bool:
        """Whether its processes put the web pages' gate in front of their HTTP servers."""
        return webauth.PRELOAD in self.scheduler_options.get("preload", ())

    def python_command(self, host: str) -> str:
        """The remote interpreter prefixed with ``env K=V``: SSHCluster puts it verbatim in front
        of ``-m distributed.cli.dask_spec``, so this reaches the nanny, the worker and the
        scheduler alike (file paths only: no key material on any command line)."""
        env = self.remote_env(host)
        if not env:
            return shlex.quote(self.remote_python)
        pairs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        return f"env {pairs} {shlex.quote(self.remote_python)}"

    def commands(self) -> dict[str, list[str]]:
        """Per host, the commands that will run there (what ``profiles render`` shows)."""
        out: dict[str, list[str]] = {host: [] for host in self.hosts}
        spec = json.dumps({"cls": "distributed.Scheduler", "opts": self.scheduler_options})
        python = self.python_command(self.scheduler_host)
        out[self.scheduler_host].append(
            f"{python} -m distributed.cli.dask_spec --spec {shlex.quote(spec)}"
        )
        for host in self.worker_hosts:
            opts = dict(self.worker_options[host])
            count = opts.pop("n_workers", 1)
            spec = json.dumps({i: {"cls": self.worker_class, "opts": opts} for i in range(count)})
            out[host].append(
                f"{self.python_command(host)} -m distributed.cli.dask_spec <scheduler> --spec "
                f"{shlex.quote(spec)}"
            )
        return out


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def bind_address(host: str) -> str | None:
    """The IP to bind on ``host``: the address this client reaches it by.

    Names are resolved here, not on the host: Debian maps a machine's own name to 127.0.1.1,
    which would make a scheduler unreachable from every other host.
    """
    if is_ip(host):
        return host
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except OSError:
        return None


def connect_options(
    profile: SSHProfile, timeout: float | None = None, quiet: bool = False
) -> dict[str, Any]:
    """Keyword arguments for ``asyncssh.connect``: strict host keys unless turned off (said
    once per start: ``quiet`` for the other calls)."""
    opts: dict[str, Any] = {"port": profile.port}
    if profile.user:
        opts["username"] = profile.user
    if profile.identity_files:
        opts["client_keys"] = [os.path.expanduser(p) for p in profile.identity_files]
    if not profile.strict_host_keys:
        if not quiet:
            logger.warning(
                "profile '%s': strict_host_keys is false, SSH host keys are NOT verified "
                "(a man in the middle could run the cluster)",
                profile.name,
            )
        opts["known_hosts"] = None
    elif profile.known_hosts:
        opts["known_hosts"] = os.path.expanduser(profile.known_hosts)
    # else asyncssh reads ~/.ssh/known_hosts and refuses unknown hosts: strict by default.
    connect = profile.connect_timeout if timeout is None else min(profile.connect_timeout, timeout)
    opts["connect_timeout"] = connect
    opts["login_timeout"] = connect
    return opts


def scheduler_options(profile: SSHProfile, security: ClusterSecurity) -> dict[str, Any]:
    """Options of the remote ``distributed.Scheduler``, bound to one address or interface."""
    spec = profile.scheduler
    host = spec.host
    if host is None and spec.interface is None:
        host = bind_address(scheduler_host(profile))
    found = {"protocol": security.scheme, **options.scheduler_options(profile, host)}
    return {**found, **_gate(security, [])}


def _gate(security: ClusterSecurity, modules: list[str]) -> dict[str, Any]:
    """The preloads of a remote process: ``modules``, then the web pages' gate (its secret's
    copy named by environment, :meth:`Plan.remote_env`)."""
    gate = [webauth.PRELOAD] if security.web_token_file else []
    return {"preload": [*modules, *gate]} if modules or gate else {}


def worker_options(profile: SSHProfile, security: ClusterSecurity, host: str) -> dict[str, Any]:
    """Options of the worker processes on ``host``."""
    opts: dict[str, Any] = {
        "n_workers": profile.workers_per_host,
        "nthreads": profile.worker.threads,
        "memory_limit": profile.worker.memory,
        "protocol": security.scheme,
        "death_timeout": profile.death_timeout,
    }
    if profile.interface:
        opts["interface"] = profile.interface
    else:
        bind = bind_address(host)
        if bind:
            opts["host"] = bind
    resources = profile.worker_resources()
    if profile.worker.gpus:
        # one CUDAWorker per host starts one worker per visible GPU, each owning one
        opts["n_workers"] = 1
        resources["GPU"] = 1.0
        opts.update(options.ucx_flags(profile))
        opts.update(cuda.worker_keywords(profile.cuda))  # the `dask cuda worker` options
    if resources and profile.worker.gpus:  # CUDAWorker takes `dask cuda worker --resources`
        opts["resources"] = " ".join(f"{name}={amount:g}" for name, amount in resources.items())
    elif resources:
        opts["resources"] = resources
    return {**opts, **_gate(security, list(profile.preload))}


def scheduler_host(profile: SSHProfile) -> str:
    return profile.scheduler_host or profile.hosts[0]


def plan(profile: SSHProfile, security: ClusterSecurity, timeout: float | None = None) -> Plan:
    """The whole start plan of a profile (pure, apart from resolving host names)."""
    env = {**security.env, **profile.env}
    if profile.worker.gpus:
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(profile.worker.gpus))))
        env.update(cuda.worker_config_env(profile.cuda))
    return Plan(
        scheduler_host=scheduler_host(profile),
        worker_hosts=list(profile.hosts),
        connect_options=connect_options(profile, timeout),
        scheduler_options=scheduler_options(profile, security),
        worker_options={h: worker_options(profile, security, h) for h in profile.hosts},
        worker_class=CUDA_WORKER_CLASS if profile.worker.gpus else WORKER_CLASS,
        remote_python=profile.remote_python or sys.executable,
        env=env,
        tls=security.tls,
    )
