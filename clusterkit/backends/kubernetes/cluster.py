"""KubeCluster handles, with the scheme and certificates of TLS clusters.

dask-kubernetes builds ``tcp://`` addresses and plain ``rpc``s to the scheduler; for a TLS
cluster this subclass swaps in the ``tls://`` scheme and the cluster's connection arguments.
Everything else (finding the Service, waiting for the pod, scale, adapt) is the library's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterkit.security import ClusterSecurity


def _cluster_class() -> type:
    from dask_kubernetes.operator import KubeCluster

    class SecureKubeCluster(KubeCluster):  # type: ignore[misc]
        """KubeCluster whose scheduler address and comms honour the cluster's security."""

        def __init__(
            self, *args: Any, ck_security: ClusterSecurity, ck_timeout: float, **kwargs: Any
        ) -> None:
            self._ck_security = ck_security
            self._ck_timeout = ck_timeout
            self.security = ck_security.distributed()
            try:
                super().__init__(*args, **kwargs)
            except BaseException:
                runner = getattr(self, "_loop_runner", None)
                if runner is not None:  # the loop thread __init__ started
                    runner.stop()
                raise

        def _connection_args(self) -> dict[str, Any]:
            if self.security is None:
                return {}
            return dict(self.security.get_connection_args("client"))

        async def _get_scheduler_address(self) -> str:
            address: str = await super()._get_scheduler_address()
            scheme = self._ck_security.scheme
            return address if scheme == "tcp" else f"{scheme}://{address.split('://', 1)[1]}"

        async def _connect_cluster(self) -> None:
            """The library's connect, bounded: it waits forever on a scheduler that crashed."""
            connecting = (
                super()._connect_cluster()
                if self._ck_security.scheme == "tcp"
                else _connect_tls(self)
            )
            try:
                await asyncio.wait_for(connecting, self._ck_timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"the scheduler of DaskCluster {self.namespace}/{self.name} did not answer "
                    f"within {self._ck_timeout:.0f}s"
                ) from None

    return SecureKubeCluster


async def _connect_tls(cluster: Any) -> None:
    """KubeCluster's connect with TLS-aware comms (the library's helper opens plain rpcs)."""
    from dask_kubernetes.operator.kubecluster.kubecluster import (
        wait_for_scheduler,
        wait_for_service,
    )
    from dask_kubernetes.operator.networking import get_scheduler_address
    from distributed.core import rpc

    if cluster.shutdown_on_close is None:
        cluster.shutdown_on_close = False
    await wait_for_scheduler(cluster.name, cluster.namespace, timeout=cluster._resource_timeout)
    await wait_for_service(f"{cluster.name}-scheduler", cluster.namespace)
    address = await cluster._get_scheduler_address()
    args = cluster._connection_args()
    while True:
        try:
            async with rpc(address, connection_args=args) as comm:
                await comm.versions()
            break
        except OSError:
            await asyncio.sleep(0.1)
    cluster.scheduler_comm = rpc(address, connection_args=args)
    dashboard = await get_scheduler_address(
        f"{cluster.name}-scheduler",
        cluster.namespace,
        port_name="http-dashboard",
        port_forward_cluster_ip=cluster.port_forward_cluster_ip,
    )
    cluster.forwarded_dashboard_port = dashboard.split(":")[-1]


def connect(name: str, namespace: str, security: ClusterSecurity, timeout: float) -> Any:
    """A handle on an existing DaskCluster that never deletes it when closed; TimeoutError if
    its scheduler does not answer within ``timeout``."""
    from dask_kubernetes.operator.kubecluster.kubecluster import CreateMode

    cls = _cluster_class()
    return cls(
        name=name,
        namespace=namespace,
        ck_security=security,
        ck_timeout=timeout,
        quiet=True,
        create_mode=CreateMode.CONNECT_ONLY,
        shutdown_on_close=False,
        resource_timeout=int(timeout),
    )
