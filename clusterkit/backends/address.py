"""Attach to a scheduler that already runs (a Helm release, a Terraform output, a colleague's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from clusterkit.backends.base import Backend, Capability, Check
from clusterkit.errors import BadInput, ClusterStartError
from clusterkit.schema import AddressProfile
from clusterkit.security import is_loopback

if TYPE_CHECKING:
    from distributed import Client

    from clusterkit.security import ClusterSecurity


class AddressBackend(Backend):
    """A scheduler someone else runs: nothing to start, ``connect`` attaches."""

    NAME = "address"
    Profile = AddressProfile
    CAPABILITIES = frozenset({Capability.TLS, Capability.UCX, Capability.ATTACH_ONLY})

    def render(self, profile: AddressProfile, security: ClusterSecurity) -> str:
        tls = f" with TLS files {profile.tls.model_dump()}" if profile.tls else ""
        return f"attach to the running scheduler at {profile.address}{tls}\n"

    def connect(
        self, profile: AddressProfile, security: ClusterSecurity, *, timeout: float
    ) -> Client:
        """A client to the profile's address, waiting for its minimum workers."""
        from distributed import Client

        if profile.protocol == "tls" and profile.tls is None:
            raise BadInput(f"profile '{profile.name}': protocol tls needs `tls:` files")
        if not security.tls and not profile.allow_plaintext and not is_loopback(profile.address):
            raise BadInput(
                f"profile '{profile.name}': refusing to attach in plaintext to {profile.address}, "
                "which is not on this machine (anything on the path can read and inject tasks)",
                hint="use the scheduler's tls:// address with `tls:` files, or set "
                "`allow_plaintext: true` if that network is yours alone",
            )
        try:
            client = Client(
                profile.address,
                security=security.distributed(),
                timeout=timeout,
                set_as_default=False,
            )
        except OSError as error:
            raise ClusterStartError(
                f"cannot reach {profile.address}: {error}",
                component="scheduler",
                hint="is the scheduler running, and is the address reachable from here?",
            ) from error
        if profile.workers:
            try:
                client.wait_for_workers(profile.workers, timeout=profile.start_timeout)
            except TimeoutError as error:
                client.close()
                raise ClusterStartError(
                    f"fewer than {profile.workers} workers after {profile.start_timeout:.0f}s",
                    component="workers",
                ) from error
        return client

    def doctor(self, profile: AddressProfile, security: ClusterSecurity) -> list[Check]:
        try:
            with self.connect(profile, security, timeout=10) as client:
                count = len(client.scheduler_info(n_workers=-1)["workers"])
            return [Check("scheduler reachable", True, f"{profile.address}: {count} workers")]
        except Exception as error:
            return [
                Check(
                    "scheduler reachable",
                    False,
                    str(error),
                    fix="check the address, the network path and the TLS files",
                )
            ]
