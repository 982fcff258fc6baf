"""Fields every profile has, and the specs they are made of (workers, scheduler, adapt, UCX)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from clusterkit.units import Duration, Port, Size

#: A sane ceiling on workers in one profile: more is almost surely a typo.
MAX_WORKERS = 1024
MAX_THREADS = 256
MAX_GPUS_PER_WORKER = 16


class Strict(BaseModel):
    # defer_build: a model's validator is built when it first validates, so loading a `local`
    # profile pays for the local models, not for every backend's
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


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
    port: Port = Field(0, description="scheduler port; 0 picks a free one")
    dashboard: bool = Field(True, description="serve the Dask dashboard")
    dashboard_port: Port = Field(0, description="dashboard port; 0 picks a free one")


class AdaptSpec(Strict):
    minimum: int = Field(0, ge=0, le=MAX_WORKERS, description="fewest workers to keep")
    maximum: int = Field(..., ge=1, le=MAX_WORKERS, description="most workers to scale to")

    @model_validator(mode="after")
    def _ordered(self) -> AdaptSpec:
        if self.minimum > self.maximum:
            raise ValueError(f"minimum ({self.minimum}) is above maximum ({self.maximum})")
        return self


class UCXSpec(Strict):
    """UCX transports. ``tls`` overrides UCX_TLS; unset picks a default that works on TCP hosts."""

    tls: list[str] | None = Field(
        None, description="UCX_TLS transports; unset: a default for TCP hosts"
    )
    nvlink: bool = Field(False, description="use NVLink between GPUs of a host")
    infiniband: bool = Field(False, description="use InfiniBand between hosts")
    rdmacm: bool = Field(False, description="connect over RDMA CM (with infiniband)")


class TLSFiles(Strict):
    ca_file: str = Field(..., description="the CA certificate (PEM) the scheduler's is signed by")
    cert_file: str = Field(..., description="the client certificate (PEM)")
    key_file: str = Field(..., description="the client's private key (PEM); keep it private")


class ProfileCommon(Strict):
    """Fields every profile has."""

    description: str = Field("", description="one line shown by `profiles list`")
    protocol: Literal["tcp", "tls", "ucx"] = Field(
        "tls",
        description="tls (default): mutual TLS with a fresh CA per cluster; tcp and ucx let "
        "anyone who reaches the scheduler run code as you",
    )
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

    @property
    def min_workers(self) -> int:
        """Workers to wait for before the cluster counts as started."""
        return 0

    @property
    def gpus_per_worker(self) -> int:
        return 0

    @property
    def adapt_spec(self) -> AdaptSpec | None:
        """Adaptive scaling bounds, for profiles that start a cluster."""
        return None

    def digest(self) -> str:
        """Stable hash of the resolved profile: records remember what they were started from."""
        import hashlib

        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class ClusterProfile(ProfileCommon):
    """Fields of every backend that starts a cluster."""

    #: ``cuda`` options are LocalCUDACluster keywords (else `dask cuda worker` options).
    CUDA_CLUSTER_KEYWORDS: ClassVar[bool] = False

    workers: int = Field(2, ge=0, le=MAX_WORKERS, description="workers to start")
    worker: WorkerSpec = Field(WorkerSpec(), description="what each worker process gets")
    scheduler: SchedulerSpec = Field(SchedulerSpec(), description="where the scheduler listens")
    adapt: AdaptSpec | None = Field(None, description="scale with the load; unset: fixed size")
    idle_timeout: Duration | None = Field(None, description="close the cluster when idle this long")
    death_timeout: Duration = Field(
        60.0, description="a worker that cannot reach its scheduler this long exits"
    )
    preload: list[str] = Field(default_factory=list, description="modules every worker preloads")
    ucx: UCXSpec = Field(UCXSpec(), description="UCX transports, for protocol ucx")
    cuda: dict[str, Any] = Field(
        default_factory=dict,
        description="more dask-cuda options by name (LocalCUDACluster keywords for local-cuda, "
        "`dask cuda worker` options for GPU workers elsewhere), checked against dask-cuda",
    )

    @property
    def min_workers(self) -> int:
        """Workers `up` waits for before it answers."""
        return self.adapt.minimum if self.adapt else self.workers

    @property
    def gpus_per_worker(self) -> int:
        return self.worker.gpus

    @property
    def adapt_spec(self) -> AdaptSpec | None:
        return self.adapt

    @property
    def max_workers(self) -> int:
        """The most Dask workers this profile's cluster can have."""
        return max(self.workers or 0, self.adapt.maximum if self.adapt else 0)

    def worker_shapes(self) -> list[tuple[int, int, float]]:
        """``(count, threads, GPU resource)`` per group of alike Dask workers, at most size."""
        return [(self.max_workers, self.worker.threads, float(self.gpus_per_worker))]

    def rank_capacity(self) -> int:
        """The most DDP ranks the cluster can provide (see ``clusterkit.capacity``)."""
        from clusterkit.capacity import rank_capacity

        return rank_capacity(self.worker_shapes())

    def worker_resources(self) -> dict[str, float]:
        """Dask resources each worker advertises: GPU count plus the profile's own."""
        resources = dict(self.worker.resources)
        if self.gpus_per_worker:
            resources.setdefault("GPU", float(self.gpus_per_worker))
        return resources

    @field_validator("cuda")
    @classmethod
    def _cuda_options_known(cls, options: dict[str, Any]) -> dict[str, Any]:
        if options:
            from clusterkit.schema import cuda

            cuda.check(options, local=cls.CUDA_CLUSTER_KEYWORDS)
        return options

    @model_validator(mode="after")
    def _cuda_options_need_gpus(self) -> ClusterProfile:
        if self.cuda and not self.gpus_per_worker:
            raise ValueError("cuda options need GPU workers (worker.gpus: 1)")
        return self

    @model_validator(mode="after")
    def _release_threshold_needs_async(self) -> ClusterProfile:
        """dask-cuda's own rule, refused only once the workers start (on the GPU machine)."""
        threshold = self.cuda.get("rmm_release_threshold") is not None
        if threshold and not (self.cuda.get("rmm_async") or getattr(self, "rmm_async", False)):
            raise ValueError("cuda.rmm_release_threshold needs rmm_async: true (dask-cuda's rule)")
        return self

    @model_validator(mode="after")
    def _adapt_within_ceiling(self) -> ClusterProfile:
        if self.adapt and self.adapt.maximum < self.workers:
            raise ValueError(
                f"workers ({self.workers}) is above adapt.maximum ({self.adapt.maximum})"
            )
        return self
