"""One pydantic model per backend, each with the fields only it has."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from clusterkit.schema.common import (
    MAX_WORKERS,
    ClusterProfile,
    Duration,
    ProfileCommon,
    Size,
    Strict,
    TLSFiles,
    WorkerSpec,
)
from clusterkit.units import Port, Walltime, walltime_seconds


class LocalProfile(ClusterProfile):
    """Worker processes on this machine (distributed.LocalCluster)."""

    backend: Literal["local"] = Field(..., description="the system that runs the cluster")
    processes: bool = Field(True, description="workers in processes; false: threads here")


class LocalCUDAProfile(ClusterProfile):
    """One worker per GPU on this machine (dask_cuda.LocalCUDACluster)."""

    backend: Literal["local-cuda"] = Field(..., description="the system that runs the cluster")
    CUDA_CLUSTER_KEYWORDS: ClassVar[bool] = True
    workers: int | None = Field(  # type: ignore[assignment]
        None, ge=1, le=MAX_WORKERS, description="workers; unset = one per visible GPU"
    )
    worker: WorkerSpec = Field(WorkerSpec(gpus=1), description="each worker: one GPU")
    devices: list[int] | None = Field(None, description="CUDA_VISIBLE_DEVICES, e.g. [0, 1]")
    rmm_pool_size: Size | None = Field(None, description="RMM pool per GPU (dask-cuda)")
    rmm_managed_memory: bool = Field(False, description="RMM managed memory (dask-cuda)")
    rmm_async: bool = Field(False, description="RMM's async allocator (dask-cuda)")
    device_memory_limit: Size | float | None = Field(
        None, description="spill to host above this (bytes, or a fraction of the device)"
    )
    enable_cudf_spill: bool = Field(False, description="cuDF's own spilling (dask-cuda)")

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

    backend: Literal["ssh"] = Field(..., description="the system that runs the cluster")
    hosts: list[str] = Field(..., min_length=1, description="worker hosts")
    scheduler_host: str | None = Field(None, description="default: the first of hosts")
    user: str | None = Field(None, description="SSH user; default: yours")
    port: Port = Field(22, description="SSH port of the hosts")
    identity_files: list[str] = Field(default_factory=list, description="SSH private keys to use")
    known_hosts: str | None = Field(None, description="default: ~/.ssh/known_hosts")
    strict_host_keys: bool = Field(True, description="false turns host-key checks off (warned)")
    remote_python: str | None = Field(None, description="python on the hosts; default: this one")
    workers_per_host: int = Field(1, ge=1, le=MAX_WORKERS, description="workers on each host")
    interface: str | None = Field(None, description="interface workers bind and advertise")
    connect_timeout: Duration = Field(10.0, description="SSH connection timeout per host")
    workers: int = Field(0, ge=0, le=MAX_WORKERS, description="ignored: hosts x workers_per_host")

    @property
    def min_workers(self) -> int:
        per_host = self.worker.gpus or self.workers_per_host  # dask-cuda: one worker per GPU
        return len(self.hosts) * per_host

    @property
    def max_workers(self) -> int:
        return self.min_workers

    def worker_shapes(self) -> list[tuple[int, int, float]]:
        # one CUDAWorker per host starts a worker per GPU, each owning one (resource GPU=1)
        return [(self.max_workers, self.worker.threads, 1.0 if self.worker.gpus else 0.0)]

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
    account: str | None = Field(None, description="account or project charged")
    walltime: Walltime = Field("01:00:00", description="per job, HH:MM:SS")
    cores: int = Field(1, ge=1, le=1024, description="cores per job")
    memory: Size = Field(4 * 2**30, description="memory per job")
    processes: int = Field(1, ge=1, le=256, description="worker processes per job")
    job_extra: list[str] = Field(default_factory=list, description="extra scheduler directives")
    prologue: list[str] = Field(default_factory=list, description="lines run before the worker")
    interface: str | None = Field(None, description="interface workers and scheduler use")
    local_directory: str | None = Field(None, description="workers' scratch on the node")
    log_directory: str | None = Field(None, description="where job logs go")
    lifetime: Duration | None = Field(None, description="worker lifetime; default below walltime")
    lifetime_stagger: Duration | None = Field(None, description="spread of worker lifetimes")
    lifetime_restart: bool = Field(
        False, description="restart the worker in the same job at its lifetime (not for walltime)"
    )
    python: str | None = Field(None, description="python on the compute nodes")
    job_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$",
        description="how jobs show in the queue; default ck-<cluster name>-<id>",
    )

    @property
    def cores_per_worker(self) -> int:
        return max(1, self.cores // self.processes)

    @model_validator(mode="before")
    @classmethod
    def _derive_threads(cls, data: Any) -> Any:
        """Unless ``worker.threads`` is given (fewer, e.g. one fit per GPU at a time), each
        worker runs cores/processes threads."""
        if not isinstance(data, dict):
            return data
        worker = data.get("worker")
        if worker is None:
            worker = {}
        cores, processes = data.get("cores", 1), data.get("processes", 1)
        derivable = isinstance(cores, int) and isinstance(processes, int) and processes > 0
        if isinstance(worker, dict) and "threads" not in worker and derivable:
            return {**data, "worker": {**worker, "threads": max(1, cores // processes)}}
        return data

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
        if self.worker.memory != "auto":
            raise ValueError(
                "worker.memory is derived for batch jobs: set memory (per job) and processes; "
                "each worker gets memory/processes"
            )
        if self.worker.threads > self.cores_per_worker:
            raise ValueError(
                f"worker.threads ({self.worker.threads}) is above the cores each worker has "
                f"(cores/processes = {self.cores_per_worker})"
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

    backend: Literal["slurm"] = Field(..., description="the system that runs the cluster")
    gpu_directive: Literal["gres", "gpus-per-task"] = Field(
        "gres", description="how a job asks for GPUs: --gres=gpu:N or --gpus-per-task=N"
    )
    requeue: bool = Field(
        False, description="--batch runs: requeue the job at walltime or preemption, resuming"
    )


class PBSProfile(JobQueueProfile):
    """Workers in PBS jobs (dask_jobqueue.PBSCluster)."""

    backend: Literal["pbs"] = Field(..., description="the system that runs the cluster")
    resource_spec: str | None = Field(None, description="override the select=... line")
    requeue: bool = Field(
        False, description="--batch runs: requeue the job at walltime or preemption, resuming"
    )


_RESOURCE_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]*$"


class SGEProfile(JobQueueProfile):
    """Workers in Grid Engine jobs (dask_jobqueue.SGECluster); ``account`` is the project
    (``-P``). Memory and GPU requests use the site's resource names."""

    backend: Literal["sge"] = Field(..., description="the system that runs the cluster")
    parallel_environment: str | None = Field(
        None, description="PE that gives a job `cores` slots (-pe NAME cores), e.g. smp"
    )
    gpu_resource: str = Field(
        "gpu", pattern=_RESOURCE_NAME, description="the site's GPU resource (-l NAME=gpus)"
    )
    memory_resource: str | None = Field(
        None,
        pattern=_RESOURCE_NAME,
        description="memory resource, per slot (-l NAME=memory/slots), e.g. h_vmem, mem_free",
    )
    resource_spec: str | None = Field(None, description="override the -l resource list")

    @model_validator(mode="after")
    def _slots(self) -> SGEProfile:
        if self.cores > 1 and not self.parallel_environment:
            raise ValueError(
                f"cores: {self.cores} needs parallel_environment (e.g. smp): without one a "
                "Grid Engine job gets one slot"
            )
        return self


class HTCondorProfile(JobQueueProfile):
    """Workers in HTCondor jobs (dask_jobqueue.HTCondorCluster); ``account`` is the
    accounting group; ``job_extra`` holds submit commands (``key = value``)."""

    backend: Literal["htcondor"] = Field(..., description="the system that runs the cluster")
    disk: Size = Field(10 * 2**30, description="scratch disk per job (request_disk)")

    @model_validator(mode="after")
    def _submit_commands(self) -> HTCondorProfile:
        if self.queue:
            raise ValueError(
                "HTCondor has no queues: match machines with job_extra: ['requirements = ...']"
            )
        for line in self.job_extra:
            if "=" not in line:
                raise ValueError(f"job_extra: {line!r} is not a submit command (key = value)")
        return self


class K8sResources(Strict):
    requests: dict[str, str] = Field(default_factory=dict, description="container requests")
    limits: dict[str, str] = Field(default_factory=dict, description="container limits")


class WorkerGroup(Strict):
    """An extra worker group (e.g. CPU workers beside GPU workers)."""

    name: str = Field(
        ...,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=40,
        description="the group's name",
    )
    workers: int = Field(1, ge=0, le=MAX_WORKERS, description="workers in the group")
    worker: WorkerSpec = Field(WorkerSpec(), description="each worker of the group")
    image: str | None = Field(None, description="unset = the profile's")
    resources: K8sResources = Field(K8sResources(), description="each worker pod's")
    node_selector: dict[str, str] | None = Field(
        None, description="unset = the profile's; {} = none (e.g. CPU workers)"
    )
    tolerations: list[dict[str, Any]] | None = Field(
        None, description="unset = the profile's; [] = none"
    )


class KubernetesProfile(ClusterProfile):
    """A DaskCluster resource run by the dask-kubernetes operator."""

    backend: Literal["kubernetes"] = Field(..., description="the system that runs the cluster")
    image: str = Field("ghcr.io/dask/dask:2026.7.1-py3.11", description="container image")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="the pods' imagePullPolicy"
    )
    namespace: str = Field(
        "default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Kubernetes namespace"
    )
    context: str | None = Field(None, description="kubeconfig context")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="the scheduler Service's type"
    )
    resources: K8sResources = Field(K8sResources(), description="each worker pod's")
    scheduler_resources: K8sResources = Field(K8sResources(), description="the scheduler pod's")
    node_selector: dict[str, str] = Field(default_factory=dict, description="pods' nodeSelector")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="pods' tolerations")
    worker_groups: list[WorkerGroup] = Field(
        default_factory=list, description="more worker groups beside the default one"
    )

    def worker_shapes(self) -> list[tuple[int, int, float]]:
        groups = [(g.workers, g.worker.threads, float(g.worker.gpus)) for g in self.worker_groups]
        return [*super().worker_shapes(), *groups]


class AddressProfile(ProfileCommon):
    """Attach to a scheduler that already runs (Helm, Terraform, a colleague's)."""

    backend: Literal["address"] = Field(..., description="the system that runs the cluster")
    address: str = Field(
        ...,
        pattern=r"^(tcp|tls|ucx|ucxx|ws|wss)://[^\s/]+:\d+$",
        description="the running scheduler's SCHEME://HOST:PORT",
    )
    tls: TLSFiles | None = Field(None, description="client certificate files, for tls://")
    workers: int = Field(0, ge=0, le=MAX_WORKERS, description="workers to wait for on attach")
    allow_plaintext: bool = Field(
        False, description="attach without TLS to a scheduler that is not on this machine"
    )

    @model_validator(mode="before")
    @classmethod
    def _protocol_from_address(cls, data: Any) -> Any:
        """Without `protocol`, the address's scheme says it (tcp://, tls://, ucx://)."""
        if isinstance(data, dict) and "protocol" not in data:
            scheme = str(data.get("address", "")).partition("://")[0]
            if scheme in ("tcp", "tls", "ucx"):
                return {**data, "protocol": scheme}
        return data

    @model_validator(mode="after")
    def _tls_files(self) -> AddressProfile:
        if self.protocol == "tls" and self.tls is None:
            raise ValueError(
                "a tls:// scheduler needs the client's `tls:` files (ca_file, cert_file, key_file)"
            )
        return self

    @property
    def min_workers(self) -> int:
        return self.workers
