"""Runs the real dask-kubernetes operator (kopf, standalone, cluster-wide) against the emulator.

The operator reaches schedulers through in-cluster Service DNS names
(``NAME-scheduler.NAMESPACE``); this process resolves those to 127.0.0.1, where the kubelet
shim runs the scheduler on the port it wrote into the Service.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from .kubelet import service_host


def patch_cluster_dns() -> None:
    """Resolve scheduler Service names to loopback in this process (the cluster's DNS)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and service_host(host):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]


async def run_operator(stop: asyncio.Event, ready: asyncio.Event) -> None:
    """The operator's kopf main loop, until ``stop`` is set."""
    import dask_kubernetes.operator.controller  # noqa: F401 - registers the kopf handlers
    import kopf

    await kopf.operator(standalone=True, clusterwide=True, stop_flag=stop, ready_flag=ready)
