"""Clusters on this machine: distributed.LocalCluster and dask_cuda.LocalCUDACluster."""

from __future__ import annotations

import json
import logging
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

from clusterkit import webauth
from clusterkit.backends.base import Backend, Capability, Check, Requirement
from clusterkit.backends.options import LOOPBACK, dashboard_address, ucx_flags
from clusterkit.errors import BackendUnavailable, ClusterStartError
from clusterkit.schema import LocalCUDAProfile, LocalProfile

if TYPE_CHECKING:
    from distributed.deploy.cluster import Cluster

    from clusterkit.schema import ClusterProfile
    from clusterkit.security import ClusterSecurity

logger = logging.getLogger(__name__)

#: preloaded first in every worker process: ends it without the final garbage collection
QUICK_EXIT = "clusterkit.backends.quick_exit"


def common_kwargs(profile: ClusterProfile, security: ClusterSecurity) -> dict[str, Any]:
    """LocalCluster keyword arguments shared by the CPU and CUDA flavours."""
    scheduler = profile.scheduler
    host = None if scheduler.interface else (scheduler.host or LOOPBACK)
    # with the dashboard off the scheduler still serves HTTP (health, metrics): port 0, never 8787
    dashboard_port = scheduler.dashboard_port if scheduler.dashboard else 0
    scheduler_kwargs: dict[str, Any] = {} if scheduler.dashboard else {"dashboard": False}
    if profile.idle_timeout:
        scheduler_kwargs["idle_timeout"] = profile.idle_timeout
    scheduler_kwargs.update(webauth.preloads(security.web_token_file, []))
    kwargs: dict[str, Any] = {
        "n_workers": profile.workers,
        "threads_per_worker": profile.worker.threads,
        "memory_limit": profile.worker.memory,
        "death_timeout": profile.death_timeout,
        "host": host,
        "interface": scheduler.interface,
        "scheduler_port": scheduler.port,
        "dashboard_address": dashboard_address(host, dashboard_port),
        "protocol": f"{security.scheme}://",
        "security": security.distributed(),
        "scheduler_kwargs": scheduler_kwargs or None,
    }
    resources = profile.worker_resources()
    if resources:
        kwargs["resources"] = resources
    in_processes = getattr(profile, "processes", True)  # not in this process's own threads
    preload = [QUICK_EXIT] if in_processes else []
    preload += profile.preload
    kwargs.update(webauth.preloads(security.web_token_file, preload))
    if profile.env:
        kwargs["env"] = dict(profile.env)
    return {k: v for k, v in kwargs.items() if v is not None or k == "dashboard_address"}


def _require_ucx(profile: ClusterProfile) -> None:
    if profile.protocol == "ucx" and find_spec("distributed_ucxx") is None:
        raise BackendUnavailable(profile.name, "distributed-ucxx", "ucx")


def _check_memory(profile: ClusterProfile) -> None:
    memory = profile.worker.memory
    if memory == "auto":
        return
    from dask.utils import format_bytes
    from distributed.system import MEMORY_LIMIT

    wanted = int(memory) * (profile.workers or 1)
    if wanted > MEMORY_LIMIT:
        raise ClusterStartError(
            f"{profile.workers} workers x {format_bytes(int(memory))} need "
            f"{format_bytes(wanted)}, but this machine has {format_bytes(MEMORY_LIMIT)}",
            component="local workers",
            hint="lower worker.memory or workers, or use memory: auto",
        )


def _started(factory: Any, component: str, **kwargs: Any) -> Cluster:
    """Build a cluster, turning any start failure into a ClusterStartError with evidence."""
    try:
        return factory(**kwargs)
    except ClusterStartError:
        raise
    except Exception as error:  # distributed raises many kinds; keep the whole cause chain
        lines: list[str] = []
        cause: BaseException | None = error
        while cause is not None and len(lines) < 24:
            text = f"{type(cause).__name__}: {cause}"
            lines.extend(line for line in text.splitlines() if line.strip())
            cause = cause.__cause__ or cause.__context__
        raise ClusterStartError(
            f"could not start ({type(error).__name__})",
            component=component,
            evidence=lines[-12:],
        ) from error


def _describe_kwargs(kwargs: dict[str, Any]) -> str:
    shown = {k: v for k, v in kwargs.items() if k != "security"}
    if kwargs.get("security") is not None:
        shown["security"] = "Security(require_encryption=True, per-cluster CA)"
    return json.dumps(shown, indent=2, default=str)


class LocalBackend(Backend):
    """Worker processes on this machine."""

    NAME = "local"
    Profile = LocalProfile
    CAPABILITIES = frozenset({Capability.UCX, Capability.TLS, Capability.SCALE, Capability.ADAPT})

    def cluster_kwargs(self, profile: LocalProfile, security: ClusterSecurity) -> dict[str, Any]:
        kwargs = common_kwargs(profile, security)
        kwargs["processes"] = profile.processes
        return kwargs

    def render(self, profile: LocalProfile, security: ClusterSecurity) -> str:
        kwargs = self.cluster_kwargs(profile, security)
        return f"distributed.LocalCluster(**{_describe_kwargs(kwargs)})\n"

    def create(self, profile: LocalProfile, security: ClusterSecurity, *, name: str) -> Cluster:
        from distributed import LocalCluster

        _require_ucx(profile)
        _check_memory(profile)
        return _started(LocalCluster, "local workers", **self.cluster_kwargs(profile, security))


def gpu_inventory() -> tuple[list[dict[str, Any]], str | None]:
    """GPUs seen through NVML: (list of {index, name, memory}, None) or ([], why not)."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed (pip install 'clusterkit[cuda]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return [], f"no GPU: NVML says {error}"
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append({"index": index, "name": str(name), "memory": int(memory)})
        return gpus, None if gpus else "no GPU: NVML sees 0 devices"
    finally:
        pynvml.nvmlShutdown()


class LocalCUDABackend(Backend):
    """One dask-cuda worker per GPU on this machine."""

    NAME = "local-cuda"
    Profile = LocalCUDAProfile
    CAPABILITIES = frozenset(
        {Capability.GPU, Capability.UCX, Capability.TLS, Capability.SCALE, Capability.ADAPT}
    )
    REQUIRES = (Requirement("dask_cuda", "dask-cuda", "cuda"),)

    def cluster_kwargs(
        self, profile: LocalCUDAProfile, security: ClusterSecurity
    ) -> dict[str, Any]:
        kwargs = common_kwargs(profile, security)
        if kwargs.pop("preload_argv", None) is not None:  # dask-cuda appends a string to it:
            env = webauth.token_env(security.web_token_file)  # the gate's file by environment
            kwargs["env"] = {**kwargs.get("env", {}), **env}
        if profile.workers is None:
            kwargs.pop("n_workers", None)
        kwargs.update(
            protocol=security.scheme,  # dask-cuda checks the bare name ("ucx", not "ucx://")
            CUDA_VISIBLE_DEVICES=profile.devices,
            rmm_pool_size=profile.rmm_pool_size,
            rmm_managed_memory=profile.rmm_managed_memory,
            rmm_async=profile.rmm_async,
            enable_cudf_spill=profile.enable_cudf_spill,
            **ucx_flags(profile),
        )
        if profile.device_memory_limit is not None:
            kwargs["device_memory_limit"] = profile.device_memory_limit
        kwargs.update(profile.cuda)  # checked against LocalCUDACluster's signature on load
        return {k: v for k, v in kwargs.items() if v is not None or k == "dashboard_address"}

    def render(self, profile: LocalCUDAProfile, security: ClusterSecurity) -> str:
        kwargs = self.cluster_kwargs(profile, security)
        return f"dask_cuda.LocalCUDACluster(**{_describe_kwargs(kwargs)})\n"

    def create(self, profile: LocalCUDAProfile, security: ClusterSecurity, *, name: str) -> Cluster:
        _require_ucx(profile)
        gpus, why_not = gpu_inventory()
        if not gpus:
            raise ClusterStartError(
                why_not or "no GPU",
                component="local-cuda",
                hint="use the `local` profile on a machine without GPUs",
            )
        _check_memory(profile)
        from dask_cuda import LocalCUDACluster

        return _started(
            LocalCUDACluster, "local-cuda workers", **self.cluster_kwargs(profile, security)
        )

    def doctor(self, profile: LocalCUDAProfile, security: ClusterSecurity) -> list[Check]:
        gpus, why_not = gpu_inventory()
        wanted = len(profile.devices) if profile.devices else 1
        return [
            Check(
                "GPUs for local-cuda",
                ok=len(gpus) >= wanted,
                detail=f"{len(gpus)} visible" if gpus else (why_not or "none"),
                fix="run on a machine with NVIDIA GPUs and drivers, or use `local`",
            )
        ]
