"""Which backends exist: the built-in ones by the module path of their class, third-party ones
from the ``clusterkit.backends`` entry-point group; and the pydantic model that validates each
one's profiles.

Kept below both ``backends`` (whose ``get_backend`` builds a backend from its name) and
``profiles`` (which checks a profile's ``backend`` and validates it with that backend's model),
so neither reaches the other. Nothing here imports a backend module for a built-in name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from clusterkit.errors import CapabilityMissing

if TYPE_CHECKING:
    from clusterkit.schema import ProfileCommon

BUILTIN: dict[str, str] = {
    "local": "clusterkit.backends.local:LocalBackend",
    "local-cuda": "clusterkit.backends.local:LocalCUDABackend",
    "ssh": "clusterkit.backends.ssh.backend:SSHBackend",
    "slurm": "clusterkit.backends.jobqueue.slurm:SLURMBackend",
    "pbs": "clusterkit.backends.jobqueue.pbs:PBSBackend",
    "sge": "clusterkit.backends.jobqueue.sge:SGEBackend",
    "htcondor": "clusterkit.backends.jobqueue.htcondor:HTCondorBackend",
    "kubernetes": "clusterkit.backends.kubernetes.backend:KubernetesBackend",
    "address": "clusterkit.backends.address:AddressBackend",
}

ENTRY_POINT_GROUP = "clusterkit.backends"


def entry_points() -> dict[str, Callable[[], Any]]:
    """Third-party backends by name: each one's loader (importlib.metadata takes ~20 ms)."""
    from importlib.metadata import entry_points as installed

    return {ep.name: ep.load for ep in installed(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """Built-in backends in their usual order, then third-party ones."""
    return [*BUILTIN, *sorted(set(entry_points()) - set(BUILTIN))]


def load(name: str) -> Any:
    """What is registered under ``name``: a Backend class or instance (built-in first, then
    entry points); CapabilityMissing naming the known ones when there is none."""
    if name in BUILTIN:
        module_name, _, attr = BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module_name), attr)
    third_party = entry_points()
    if name not in third_party:
        known = ", ".join(sorted({*BUILTIN, *third_party}))
        raise CapabilityMissing(f"no backend named '{name}'", hint=f"known: {known}")
    return third_party[name]()


def profile_model(name: str) -> type[ProfileCommon]:
    """The pydantic model that validates profiles of backend ``name`` (a built-in one's from
    the schema, without importing the backend; a third-party one's from its ``Profile``)."""
    from clusterkit.schema import MODELS, ProfileCommon

    if name in BUILTIN:
        return MODELS[name]
    model = load(name).Profile
    if not (isinstance(model, type) and issubclass(model, ProfileCommon)):
        raise CapabilityMissing(f"backend '{name}' names no profile model (its Profile)")
    return model
