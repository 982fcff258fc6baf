"""Export a kubernetes profile as the Helm chart's values and the Terraform module's variables.

Both describe the same cluster: ``terraform/modules/profile`` turns the variables from
:func:`to_tfvars` into exactly the values :func:`to_helm_values` returns.
"""

from __future__ import annotations

import json
import re
from typing import Any

from clusterkit.errors import BadInput
from clusterkit.schema import KubernetesProfile

#: Same pattern as terraform/modules/profile (RE2 and Python agree on it).
_IMAGE = re.compile(
    r"^(?P<repository>[^@\s]+?)(?::(?P<tag>[^:/@\s]+))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)
_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def release_name(profile: KubernetesProfile) -> str:
    """The profile's name as a DNS label of at most 53 characters (Helm release, TF name)."""
    name = re.sub(r"[^a-z0-9-]+", "-", profile.name.lower()).strip("-")[:53].rstrip("-")
    if not name:
        raise BadInput(f"profile name {profile.name!r} gives no usable Kubernetes name")
    return name


def _memory(value: int | str) -> str:
    if value == "auto":
        return "auto"
    size = int(value)
    for unit, factor in _UNITS:
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def _image(image: str) -> dict[str, str]:
    match = _IMAGE.match(image)
    if not match:
        raise BadInput(
            f"image: expected 'repository:tag' or 'repository@sha256:...', got {image!r}"
        )
    return {
        "repository": match["repository"],
        "tag": match["tag"] or "latest",
        "digest": match["digest"] or "",
    }


def exportable(profile: KubernetesProfile) -> tuple[KubernetesProfile, list[str]]:
    """The part of ``profile`` the chart can run (its default worker group), and what is left out.

    The chart runs one worker group; each extra group is named in the notes, so a caller can
    say so instead of refusing the whole profile.
    """
    notes = [
        f"worker group '{group.name}' ({group.workers} workers) is not exported: the chart runs "
        "one worker group; deploy it as a release of its own"
        for group in profile.worker_groups
    ]
    if profile.cuda:
        notes.append(
            f"cuda options ({', '.join(profile.cuda)}) are not exported: the chart's workers "
            "take no dask-cuda options"
        )
    if not notes:
        return profile, []
    part = profile.model_copy(update={"worker_groups": [], "cuda": {}})
    part.named(profile.name, profile.source)
    return part, notes


def _variables(profile: KubernetesProfile) -> dict[str, Any]:
    """The module's variables (terraform/modules/profile) for this profile."""
    if profile.worker_groups:
        raise BadInput(
            f"profile {profile.name!r}: worker_groups cannot be exported to the chart, which runs "
            "one worker group; deploy each group as its own release"
        )
    extra = {k: v for k, v in profile.worker.resources.items() if k != "GPU"}
    return {
        "name": release_name(profile),
        "namespace": profile.namespace,
        "image": profile.image,
        "image_pull_policy": profile.image_pull_policy,
        "workers": profile.workers,
        "gpus_per_worker": profile.worker.gpus,
        "threads_per_worker": profile.worker.threads,
        "worker_memory": _memory(profile.worker.memory),
        "dask_resources": extra,
        "protocol": profile.protocol,
        "service_type": profile.service_type,
        "worker_resources": profile.resources.model_dump(),
        "scheduler_resources": profile.scheduler_resources.model_dump(),
        "node_selector": dict(profile.node_selector),
        "tolerations": list(profile.tolerations),
        "env": dict(profile.env),
        "preload": list(profile.preload),
    }


def to_helm_values(profile: KubernetesProfile) -> dict[str, Any]:
    """Values for ``charts/clusterkit`` that run the cluster this profile describes.

    Workers get the profile's node selector and tolerations; with ``protocol: tls`` (the
    default) the release issues its own CA and certificates (no ``tls.secretName``).
    """
    v = _variables(profile)
    return {
        "fullnameOverride": v["name"],
        "image": {**_image(v["image"]), "pullPolicy": v["image_pull_policy"]},
        "protocol": v["protocol"],
        "tls": {"secretName": ""},
        "env": v["env"],
        "scheduler": {
            "service": {"type": v["service_type"]},
            "resources": v["scheduler_resources"],
        },
        "worker": {
            "replicas": v["workers"],
            "threads": v["threads_per_worker"],
            "memoryLimit": v["worker_memory"],
            "gpus": v["gpus_per_worker"],
            "daskResources": v["dask_resources"],
            "preload": v["preload"],
            "resources": v["worker_resources"],
            "nodeSelector": v["node_selector"],
            "tolerations": v["tolerations"],
        },
    }


def _hcl(value: Any, indent: int = 0) -> str:
    """An HCL literal. Strings, numbers and bools are JSON literals, which HCL reads as-is."""
    pad = "  " * (indent + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        lines = [f"{pad}{json.dumps(str(k))} = {_hcl(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + "\n".join(lines) + "\n" + "  " * indent + "}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        items = [f"{pad}{_hcl(v, indent + 1)}," for v in value]
        return "[\n" + "\n".join(items) + "\n" + "  " * indent + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        # ${ and %{ start HCL templates: escape them so the value stays literal
        return json.dumps(value).replace("${", "$${").replace("%{", "%%{")
    return json.dumps(value)


def to_tfvars(profile: KubernetesProfile) -> str:
    """``terraform.tfvars`` for ``terraform/modules/dask-cluster`` (``key = value`` lines)."""
    variables = _variables(profile)
    width = max(len(key) for key in variables)
    lines = [f"# clusterkit profile {profile.name!r} (backend kubernetes)"]
    lines += [f"{key.ljust(width)} = {_hcl(value)}" for key, value in variables.items()]
    return "\n".join(lines) + "\n"
