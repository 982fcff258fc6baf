"""The ssh backend: a scheduler and workers on other machines, started over asyncssh."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from clusterkit.backends.base import Backend, Capability, Check, Requirement
from clusterkit.backends.ssh import remote as ssh_remote
from clusterkit.backends.ssh import spec as ssh_spec
from clusterkit.errors import ClusterkitError, ClusterStartError
from clusterkit.schema import SSHProfile

if TYPE_CHECKING:
    from distributed.deploy.spec import SpecCluster

    from clusterkit.security import ClusterSecurity
    from clusterkit.state import ClusterRecord


def render(profile: SSHProfile, security: ClusterSecurity) -> str:
    """The commands that will run on each host, with the SSH settings used to reach them."""
    plan = ssh_spec.plan(profile, security)
    plan.env[ssh_spec.MARKER_VAR] = "<cluster-id>"
    placeholder = f"$HOME/{ssh_spec.REMOTE_ROOT}/<cluster-id>"
    if security.server_files():
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
    if security.server_files():
        names = ", ".join(name for name, _ in security.server_files())
        lines.append(
            f"# {names} copied over SFTP to {placeholder} (0700, files 0600) on each host, "
            "removed when the cluster closes; the client's key stays here"
        )
    for host, commands in plan.commands().items():
        lines.append(f"[{host}]")
        lines.extend(f"  {command}" for command in commands)
    return "\n".join(lines) + "\n"


def create_cluster(profile: SSHProfile, security: ClusterSecurity, cluster_id: str) -> SpecCluster:
    """Start the scheduler and workers over SSH, each process and folder tagged ``cluster_id``;
    on failure, leave nothing behind and say where."""
    from clusterkit.backends.ssh.cluster import ClusterkitSSHCluster, StartLog

    start_log = StartLog(deadline=time.monotonic() + profile.start_timeout)
    plan = ssh_spec.plan(profile, security, timeout=profile.start_timeout)
    plan.env[ssh_spec.MARKER_VAR] = cluster_id
    try:
        if security.server_files():
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
            files = security.server_files()  # the client's key stays here
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


class SSHBackend(Backend):
    """A scheduler and workers on other machines, started over asyncssh."""

    NAME = "ssh"
    Profile = SSHProfile
    CAPABILITIES = frozenset(
        {Capability.GPU, Capability.UCX, Capability.TLS, Capability.SCALE, Capability.REMOTE}
    )
    REQUIRES = (Requirement("asyncssh", "asyncssh", "ssh"),)

    def render(self, profile: SSHProfile, security: ClusterSecurity) -> str:
        return render(profile, security)

    def identity(self, profile: SSHProfile, name: str) -> dict[str, Any]:
        """The tag every remote process and folder will carry, and how to reach the hosts."""
        hosts = list(dict.fromkeys([ssh_spec.scheduler_host(profile), *profile.hosts]))
        return {
            "cluster_id": f"{name}-{uuid.uuid4().hex[:8]}",
            "hosts": hosts,
            "ssh": ssh_spec.connect_options(profile, quiet=True),
        }

    def create(
        self,
        profile: SSHProfile,
        security: ClusterSecurity,
        *,
        name: str,
        identity: dict[str, Any] | None = None,
    ) -> SpecCluster:
        cluster_id = (identity or self.identity(profile, name))["cluster_id"]
        return create_cluster(profile, security, cluster_id)

    def evidence(self, cluster: Any, profile: SSHProfile) -> list[str]:
        """Remote stderr tails captured while the cluster started."""
        evidence: list[str] = cluster.evidence()
        return evidence

    def doctor(self, profile: SSHProfile, security: ClusterSecurity) -> list[Check]:
        from clusterkit.backends.ssh.doctor import doctor

        return doctor(profile, security)

    def record_extra(self, cluster: Any, profile: SSHProfile) -> dict[str, Any]:
        """The tag on every remote process and folder, and how to reach the hosts again."""
        plan = cluster.ssh_plan
        return {"cluster_id": cluster.cluster_id, "hosts": plan.hosts, "ssh": plan.connect_options}

    def teardown(self, record: ClusterRecord) -> None:
        """Kill every remote process tagged with the cluster's id and remove its folders."""
        extra = record.extra or {}
        if "cluster_id" not in extra:
            return
        hosts, options, cluster_id = extra["hosts"], extra["ssh"], extra["cluster_id"]
        results = ssh_remote.run_sync(
            lambda: ssh_remote.cleanup(hosts, options, cluster_id, "KILL")
        )
        failed = [f"{r.host}: {r.reason}" for r in results if not r.ok]
        if failed:
            raise ClusterkitError(
                f"could not clean up cluster '{record.name}' on {', '.join(failed)}",
                hint="check that the hosts are reachable, then run `clusterkit down` again",
            )
