"""Pydantic models of a profile: common fields and one model per backend, joined on ``backend``.

Defaults live here and nowhere else. Sizes and durations parse with dask's own parsers.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    model_validator,
)

from clusterkit.units import Duration, Port, Size, Walltime, walltime_seconds

#: A sane ceiling on workers in one profile: more is almost surely a typo.
MAX_WORKERS = 1024
MAX_THREADS = 256
MAX_GPUS_PER_WORKER = 16

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerSpec(Strict):
    """What each worker process gets."""

    threads: int = Field(1, ge=1, le=MAX_THREADS, description="threads per worker")
    memory: Size | Literal["auto"] = Field("auto", description="memory limit per worker")
    gpus: int = Field(0, ge=0, le=MAX_GPUS_PER_WORKER, description="GPUs per worker")
    resources: dict[str, float] = Field(
        default_factory=dict, description="extra Dask resources the worker advertises"
    )


class SchedulerSpec(Strict):
    """Where the scheduler listens and what it advertises."""

    host: str | None = Field(None, description="bind address; the backend's safe default if unset")
    interface: str | None = Field(None, description="network interface to bind (e.g. ib0)")
    port: Port = 0
    dashboard: bool = True
    dashboard_port: Port = 0


class AdaptSpec(Strict):
    minimum: int = Field(0, ge=0, le=MAX_WORKERS)
    maximum: int = Field(..., ge=1, le=MAX_WORKERS)

    @model_validator(mode="after")
    def _ordered(self) -> AdaptSpec:
        if self.minimum > self.maximum:
            raise ValueError(f"minimum ({self.minimum}) is above maximum ({self.maximum})")
        return self


class UCXSpec(Strict):
    """UCX transports. ``tls`` overrides UCX_TLS; unset picks a default that works on TCP hosts."""

    tls: list[str] | None = None
    nvlink: bool = False
    infiniband: bool = False
    rdmacm: bool = False


class TLSFiles(Strict):
    ca_file: str
    cert_file: str
    key_file: str


class ProfileCommon(Strict):
    """Fields every profile has."""

    description: str = ""
    protocol: Literal["tcp", "tls", "ucx"] = "tcp"
    env: dict[str, str] = Field(default_factory=dict, description="environment of every worker")
    start_timeout: Duration = Field(60.0, description="how long `up` waits for the workers")

    _name: str = PrivateAttr("anonymous")
    _source: str | None = PrivateAttr(None)

    @property
    def name(self) -> str:
        """The profile's name (its file stem)."""
        return self._name

    @property
    def source(self) -> str | None:
        """The file it was loaded from, if any."""
        return self._source

    @property
    def backend_name(self) -> str:
        return str(getattr(self, "backend"))  # noqa: B009 - every concrete model has it

    def named(self, name: str, source: str | None = None) -> ProfileCommon:
        """Attach the name and source file (loader use)."""
        self._name = name
        self._source = source
        return self

    def digest(self) -> str:
        """Stable hash of the resolved profile: records remember what they were started from."""
        import hashlib

        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class ClusterProfile(ProfileCommon):
    """Fields of every backend that starts a cluster."""

    workers: int = Field(2, ge=0, le=MAX_WORKERS, description="workers to start")
    worker: WorkerSpec = WorkerSpec()
    scheduler: SchedulerSpec = SchedulerSpec()
    adapt: AdaptSpec | None = None
    idle_timeout: Duration | None = Field(None, description="close the cluster when idle this long")
    preload: list[str] = Field(default_factory=list, description="modules every worker preloads")
    ucx: UCXSpec = UCXSpec()

    @property
    def min_workers(self) -> int:
        """Workers `up` waits for before it answers."""
        return self.adapt.minimum if self.adapt else self.workers

    @property
    def gpus_per_worker(self) -> int:
        return self.worker.gpus

    def worker_resources(self) -> dict[str, float]:
        """Dask resources each worker advertises: GPU count plus the profile's own."""
        resources = dict(self.worker.resources)
        if self.gpus_per_worker:
            resources.setdefault("GPU", float(self.gpus_per_worker))
        return resources

    @model_validator(mode="after")
    def _adapt_within_ceiling(self) -> ClusterProfile:
        if self.adapt and self.adapt.maximum < self.workers:
            raise ValueError(
                f"workers ({self.workers}) is above adapt.maximum ({self.adapt.maximum})"
            )
        return self


class LocalProfile(ClusterProfile):
    """Worker processes on this machine (distributed.LocalCluster)."""

    backend: Literal["local"]
    processes: bool = True


class LocalCUDAProfile(ClusterProfile):
    """One worker per GPU on this machine (dask_cuda.LocalCUDACluster)."""

    backend: Literal["local-cuda"]
    workers: int | None = Field(  # type: ignore[assignment]
        None, ge=1, le=MAX_WORKERS, description="workers; unset = one per visible GPU"
    )
    worker: WorkerSpec = WorkerSpec(gpus=1)
    devices: list[int] | None = Field(None, description="CUDA_VISIBLE_DEVICES, e.g. [0, 1]")
    rmm_pool_size: Size | None = None
    rmm_managed_memory: bool = False
    rmm_async: bool = False
    device_memory_limit: Size | float | None = Field(
        None, description="spill to host above this (bytes, or a fraction of the device)"
    )
    enable_cudf_spill: bool = False
    jit_unspill: bool = False

    @property
    def min_workers(self) -> int:
        if self.adapt:
            return self.adapt.minimum
        if self.workers is not None:
            return self.workers
        return len(self.devices) if self.devices else 1

    @model_validator(mode="after")
    def _one_gpu_per_worker(self) -> LocalCUDAProfile:
        if self.worker.gpus != 1:
            raise ValueError("local-cuda runs one worker per GPU: worker.gpus must be 1")
        if isinstance(self.device_memory_limit, float) and not 0 < self.device_memory_limit <= 1:
            raise ValueError("device_memory_limit as a fraction must be in (0, 1]")
        return self


class SSHProfile(ClusterProfile):
    """Workers on other machines over SSH (distributed.SSHCluster, asyncssh)."""

    backend: Literal["ssh"]
    hosts: list[str] = Field(..., min_length=1, description="worker hosts")
    scheduler_host: str | None = Field(None, description="default: the first of hosts")
    user: str | None = None
    port: Port = 22
    identity_files: list[str] = Field(default_factory=list)
    known_hosts: str | None = Field(None, description="default: ~/.ssh/known_hosts")
    strict_host_keys: bool = Field(True, description="false turns host-key checks off (warned)")
    remote_python: str | None = Field(None, description="python on the hosts; default: this one")
    workers_per_host: int = Field(1, ge=1, le=MAX_WORKERS, description="workers on each host")
    interface: str | None = Field(None, description="interface workers bind and advertise")
    connect_timeout: Duration = 10.0
    workers: int = Field(0, ge=0, le=MAX_WORKERS, description="ignored: hosts x workers_per_host")

    @property
    def min_workers(self) -> int:
        per_host = self.worker.gpus or self.workers_per_host  # dask-cuda: one worker per GPU
        return len(self.hosts) * per_host

    @model_validator(mode="after")
    def _gpus_per_host(self) -> SSHProfile:
        if self.worker.gpus and self.workers_per_host != 1:
            raise ValueError(
                "with worker.gpus, each host runs one worker per GPU (dask-cuda): "
                "leave workers_per_host at 1"
            )
        return self


class JobQueueProfile(ClusterProfile):
    """Fields shared by batch-scheduler backends (dask-jobqueue).

    A job runs ``processes`` workers that share its ``cores`` and ``memory``; ``workers``
    counts workers (not jobs). With GPUs each worker is a dask-cuda worker with one GPU,
    so a job asks for ``processes`` GPUs.
    """

    queue: str | None = Field(None, description="queue or partition")
    account: str | None = None
    walltime: Walltime = "01:00:00"
    cores: int = Field(1, ge=1, le=1024, description="cores per job")
    memory: Size = Field(4 * 2**30, description="memory per job")
    processes: int = Field(1, ge=1, le=256, description="worker processes per job")
    job_extra: list[str] = Field(default_factory=list, description="extra scheduler directives")
    prologue: list[str] = Field(default_factory=list, description="lines run before the worker")
    interface: str | None = Field(None, description="interface workers and scheduler use")
    local_directory: str | None = None
    log_directory: str | None = None
    lifetime: Duration | None = Field(None, description="worker lifetime; default below walltime")
    lifetime_stagger: Duration | None = None
    lifetime_restart: bool = Field(
        False, description="restart the worker in the same job at its lifetime (not for walltime)"
    )
    python: str | None = Field(None, description="python on the compute nodes")
    death_timeout: Duration = 60.0
    job_name: str = Field("clusterkit", pattern=r"^[A-Za-z0-9_.-]{1,64}$")

    @model_validator(mode="after")
    def _per_job_sizes(self) -> JobQueueProfile:
        if self.processes > self.cores:
            raise ValueError(
                f"processes ({self.processes}) is above cores ({self.cores}): "
                "each worker needs at least one core"
            )
        if self.worker.gpus > 1:
            raise ValueError(
                "dask-cuda runs one worker per GPU: keep worker.gpus at 1 and set processes "
                "to the GPUs per job"
            )
        # defaults, or the derived value (a dumped profile carries it back), are fine
        given = [
            *(["threads"] if self.worker.threads not in {1, self.cores // self.processes} else []),
            *(["memory"] if self.worker.memory != "auto" else []),
        ]
        if given:
            raise ValueError(
                f"worker.{given[0]} is derived for batch jobs: set cores, memory "
                "and processes (per job); each worker gets cores/processes threads"
            )
        latest = (self.lifetime or 0) + (self.lifetime_stagger or 0)
        if self.lifetime is not None and latest >= walltime_seconds(self.walltime):
            raise ValueError(
                f"lifetime + lifetime_stagger ({latest:.0f}s) must be below the walltime "
                f"({self.walltime}) so that workers leave before the batch system kills them"
            )
        return self


class SLURMProfile(JobQueueProfile):
    """Workers in SLURM jobs (dask_jobqueue.SLURMCluster)."""

    backend: Literal["slurm"]
    gpu_directive: Literal["gres", "gpus-per-task"] = Field(
        "gres", description="how a job asks for GPUs: --gres=gpu:N or --gpus-per-task=N"
    )


class PBSProfile(JobQueueProfile):
    """Workers in PBS jobs (dask_jobqueue.PBSCluster)."""

    backend: Literal["pbs"]
    resource_spec: str | None = Field(None, description="override the select=... line")


class K8sResources(Strict):
    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)


class WorkerGroup(Strict):
    """An extra worker group (e.g. CPU workers beside GPU workers)."""

    name: str = Field(..., pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)
    workers: int = Field(1, ge=0, le=MAX_WORKERS)
    worker: WorkerSpec = WorkerSpec()
    image: str | None = None
    resources: K8sResources = K8sResources()
    node_selector: dict[str, str] | None = Field(
        None, description="unset = the profile's; {} = none (e.g. CPU workers)"
    )
    tolerations: list[dict[str, Any]] | None = Field(
        None, description="unset = the profile's; [] = none"
    )


class KubernetesProfile(ClusterProfile):
    """A DaskCluster resource run by the dask-kubernetes operator."""

    backend: Literal["kubernetes"]
    image: str = "ghcr.io/dask/dask:2026.7.1-py3.11"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    namespace: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    context: str | None = Field(None, description="kubeconfig context")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    resources: K8sResources = K8sResources()
    scheduler_resources: K8sResources = K8sResources()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    worker_groups: list[WorkerGroup] = Field(default_factory=list)


class AddressProfile(ProfileCommon):
    """Attach to a scheduler that already runs (Helm, Terraform, a colleague's)."""

    backend: Literal["address"]
    address: str = Field(..., pattern=r"^(tcp|tls|ucx|ucxx|ws|wss)://[^\s/]+:\d+$")
    tls: TLSFiles | None = None
    workers: int = Field(0, ge=0, le=MAX_WORKERS, description="workers to wait for on attach")

    @property
    def min_workers(self) -> int:
        return self.workers


AnyProfile = Union[  # noqa: UP007 - pydantic discriminated unions read clearer this way
    LocalProfile,
    LocalCUDAProfile,
    SSHProfile,
    SLURMProfile,
    PBSProfile,
    KubernetesProfile,
    AddressProfile,
]

MODELS: dict[str, type[ProfileCommon]] = {
    "local": LocalProfile,
    "local-cuda": LocalCUDAProfile,
    "ssh": SSHProfile,
    "slurm": SLURMProfile,
    "pbs": PBSProfile,
    "kubernetes": KubernetesProfile,
    "address": AddressProfile,
}


def json_schema() -> dict[str, Any]:
    """JSON Schema of a profile file, for editors."""
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(Annotated[AnyProfile, Field(discriminator="backend")])
    schema = adapter.json_schema()
    schema["title"] = "clusterkit profile"
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
