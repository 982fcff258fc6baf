"""Runs the real dask-kubernetes operator (kopf, standalone, cluster-wide) against the emulator.

The operator reaches schedulers through in-cluster Service DNS names
(``NAME-scheduler.NAMESPACE``); this process resolves those to 127.0.0.1, where the kubelet
shim runs the scheduler on the port it wrote into the Service.
"""

from __future__ import annotations

import asyncio
import dataclasses
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


#: The autoscaler's timer ticks every 5 s in the operator; the emulated cluster ticks every 1 s
#: (the same handler, asked for the scheduler's adaptive target more often).
AUTOSCALER_INTERVAL = 1.0


def quicken_timers() -> None:
    """Run the DaskAutoscaler timer at ``AUTOSCALER_INTERVAL`` (kopf handlers are frozen
    dataclasses in its registry: swapped for copies)."""
    import kopf
    from kopf._core.intents.handlers import TimerHandler

    registry = kopf.get_default_registry()._spawning
    registry._handlers = [
        dataclasses.replace(handler, interval=AUTOSCALER_INTERVAL)
        if isinstance(handler, TimerHandler) and handler.id.endswith("daskautoscaler_adapt")
        else handler
        for handler in registry._handlers
    ]


async def run_operator(stop: asyncio.Event, ready: asyncio.Event) -> None:
    """The operator's kopf main loop, until ``stop`` is set."""
    # the operator posts a k8s Event per handler run; nothing reads them but the emulator's
    # ever-growing event list, which every `pods.pod_views` scans: warnings and errors only
    import dask
    import dask_kubernetes.operator.controller  # noqa: F401 - registers the kopf handlers
    import kopf

    dask.config.set({"kubernetes.controller.events.level": "WARNING"})

    quicken_timers()
    await kopf.operator(standalone=True, clusterwide=True, stop_flag=stop, ready_flag=ready)
