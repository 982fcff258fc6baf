"""Pydantic models of a profile: common fields and one model per backend, joined on ``backend``.

Defaults live here and nowhere else. Sizes and durations parse with dask's own parsers.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field

from clusterkit.schema.backends import (
    AddressProfile,
    HTCondorProfile,
    JobQueueProfile,
    K8sResources,
    KubernetesProfile,
    LocalCUDAProfile,
    LocalProfile,
    PBSProfile,
    SGEProfile,
    SLURMProfile,
    SSHProfile,
    WorkerGroup,
)
from clusterkit.schema.common import (
    MAX_GPUS_PER_WORKER,
    MAX_THREADS,
    MAX_WORKERS,
    AdaptSpec,
    ClusterProfile,
    ProfileCommon,
    SchedulerSpec,
    Strict,
    TLSFiles,
    UCXSpec,
    WorkerSpec,
)
from clusterkit.searchpath import NAME_PATTERN

__all__ = [
    "MAX_GPUS_PER_WORKER",
    "MAX_THREADS",
    "MAX_WORKERS",
    "MODELS",
    "NAME_PATTERN",
    "AdaptSpec",
    "AddressProfile",
    "AnyProfile",
    "ClusterProfile",
    "HTCondorProfile",
    "JobQueueProfile",
    "K8sResources",
    "KubernetesProfile",
    "LocalCUDAProfile",
    "LocalProfile",
    "PBSProfile",
    "ProfileCommon",
    "SGEProfile",
    "SLURMProfile",
    "SSHProfile",
    "SchedulerSpec",
    "Strict",
    "TLSFiles",
    "UCXSpec",
    "WorkerGroup",
    "WorkerSpec",
    "json_schema",
]


AnyProfile = Union[  # noqa: UP007 - pydantic discriminated unions read clearer this way
    LocalProfile,
    LocalCUDAProfile,
    SSHProfile,
    SLURMProfile,
    PBSProfile,
    SGEProfile,
    HTCondorProfile,
    KubernetesProfile,
    AddressProfile,
]

MODELS: dict[str, type[ProfileCommon]] = {
    "local": LocalProfile,
    "local-cuda": LocalCUDAProfile,
    "ssh": SSHProfile,
    "slurm": SLURMProfile,
    "pbs": PBSProfile,
    "sge": SGEProfile,
    "htcondor": HTCondorProfile,
    "kubernetes": KubernetesProfile,
    "address": AddressProfile,
}


def json_schema() -> dict[str, Any]:
    """JSON Schema of a profile file, for editors."""
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(Annotated[AnyProfile, Field(discriminator="backend")])
    union = adapter.json_schema()
    # `extends` is resolved by the loader before validation: every profile may name a parent,
    # and a file that extends one may leave out what the parent gives (even `backend`)
    extends = {"type": "string", "description": "profile this one builds on; this file wins"}
    for model in union.get("$defs", {}).values():
        if "backend" in model.get("properties", {}):
            model["properties"]["extends"] = extends
    child = {"type": "object", "required": ["extends"], "properties": {"extends": extends}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "clusterkit profile",
        "$defs": union.pop("$defs", {}),
        "anyOf": [union, child],
    }
