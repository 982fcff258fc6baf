"""Worker and scheduler options shared by the backends that start processes (local, ssh, jobqueue).

Binding is explicit everywhere: the default of advertising the first network interface is the
most reported Dask deployment bug, so schedulers and workers bind the profile's host or
interface, else loopback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterkit.schema import ClusterProfile

LOOPBACK = "127.0.0.1"


def dashboard_address(host: str | None, port: int) -> str:
    """``HOST:PORT`` for the dashboard: the scheduler's host, else loopback (Dask would turn
    ``:PORT`` into every interface; the dashboard has no authentication). Remote dashboards
    are reached through the tunnel `clusterkit dashboard NAME` prints."""
    return f"{host or LOOPBACK}:{port}"


def scheduler_options(profile: ClusterProfile, host: str | None) -> dict[str, Any]:
    """Options of a ``distributed.Scheduler``: port, host or interface, dashboard, idle timeout.

    The dashboard address is always given: the scheduler serves HTTP (health, metrics) even
    with the dashboard off, and must never land on 8787 by chance.
    """
    spec = profile.scheduler
    options: dict[str, Any] = {"port": spec.port}
    if host:
        options["host"] = host
    elif spec.interface:
        options["interface"] = spec.interface
    options["dashboard"] = spec.dashboard
    options["dashboard_address"] = dashboard_address(host, spec.dashboard_port)
    if profile.idle_timeout:
        options["idle_timeout"] = profile.idle_timeout
    return options


def ucx_flags(profile: ClusterProfile) -> dict[str, bool]:
    """dask-cuda's UCX switches for GPU workers on protocol ucx (empty otherwise)."""
    if profile.protocol != "ucx" or not profile.gpus_per_worker:
        return {}
    return {
        "enable_tcp_over_ucx": True,
        "enable_nvlink": profile.ucx.nvlink,
        "enable_infiniband": profile.ucx.infiniband,
        "enable_rdmacm": profile.ucx.rdmacm,
    }


def ucx_cli_flags(profile: ClusterProfile) -> list[str]:
    """The same switches as ``dask cuda worker`` flags (``--enable-nvlink`` ...)."""
    return [f"--{key.replace('_', '-')}" for key, on in ucx_flags(profile).items() if on]


def resource_spec(resources: dict[str, float]) -> str:
    """``GPU=1,MEM=2`` as the worker CLIs take ``--resources``."""
    return ",".join(f"{key}={value:g}" for key, value in sorted(resources.items()))
