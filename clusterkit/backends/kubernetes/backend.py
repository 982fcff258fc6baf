"""Kubernetes: a DaskCluster run by the dask-kubernetes operator, driven through KubeCluster.

The cluster lives in the API server (DETACHED): ``up`` creates the resources and waits until
the scheduler and the minimum workers run, the record keeps name and namespace, ``down``
deletes the DaskCluster (its Deployments, Services, worker groups and Secret go with it).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clusterkit.backends.base import Capability, Check, Requirement, StatusRow
from clusterkit.backends.kubernetes.manifest import (
    GROUP_VERSION,
    cluster_name,
    manifests,
    validate_manifest,
)
from clusterkit.errors import BadInput, ClusterkitError, ClusterStartError

if TYPE_CHECKING:
    from distributed import Client

    from clusterkit.schema import KubernetesProfile
    from clusterkit.security import ClusterSecurity
    from clusterkit.state import ClusterRecord

__all__ = ["BACKEND", "validate_manifest"]

logger = logging.getLogger(__name__)

NAME = "kubernetes"
CAPABILITIES = frozenset(
    {Capability.GPU, Capability.TLS, Capability.SCALE, Capability.ADAPT, Capability.DETACHED}
)
REQUIRES = [Requirement("dask_kubernetes", "dask-kubernetes", "kubernetes")]
INSTALL_OPERATOR = (
    "install the operator: helm install --repo https://helm.dask.org --create-namespace "
    "-n dask-operator --generate-name dask-kubernetes-operator"
)
POLL = 0.25


# ---------------------------------------------------------------------------- render


def render(profile: KubernetesProfile, security: ClusterSecurity) -> str:
    """The manifests (Secret, DaskCluster, DaskWorkerGroups, DaskAutoscaler) as YAML."""
    import yaml

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    docs = manifests(profile, security, cluster_name(profile.name))
    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------- API access


def _api(context: str | None = None) -> Any:
    import kr8s

    try:
        return kr8s.api(context=context) if context else kr8s.api()
    except Exception as error:  # kubeconfig missing or unreadable
        raise ClusterkitError(
            f"no usable Kubernetes configuration: {error}",
            hint="set KUBECONFIG or create ~/.kube/config",
        ) from None


def _kind(kind: str, version: str = GROUP_VERSION, namespaced: bool = True) -> Any:
    import kr8s.objects

    return kr8s.objects.new_class(f"{kind}.{version}", asyncio=False, namespaced=namespaced)


def _api_error(error: BaseException, what: str, namespace: str) -> ClusterkitError:
    """One line with the fix, for the failures people actually meet."""
    import httpx
    import kr8s

    response = getattr(error, "response", None)
    is_http = isinstance(error, (kr8s.ServerError, httpx.HTTPStatusError))
    status = response.status_code if is_http and response is not None else None
    if status == 404:
        return ClusterkitError(
            f"{what}: the DaskCluster resource type is not installed (CRD missing)",
            hint=INSTALL_OPERATOR,
        )
    if status == 403:
        return ClusterkitError(
            f"{what}: forbidden in namespace '{namespace}' (RBAC): {error}",
            hint="ask for a Role allowing daskclusters, daskworkergroups, daskautoscalers, "
            "pods, services, secrets and events there, or pick another namespace",
        )
    if isinstance(error, (httpx.TransportError, OSError)):
        return ClusterkitError(
            f"{what}: the Kubernetes API is unreachable: {error}",
            hint="check `kubectl cluster-info`, KUBECONFIG and the profile's context",
        )
    return ClusterkitError(f"{what}: {error}")


def _check_context(profile: KubernetesProfile) -> None:
    if not profile.context:
        return
    current = _api().auth.active_context
    if current != profile.context:
        raise BadInput(
            f"profile '{profile.name}' names context '{profile.context}', the kubeconfig's "
            f"current context is '{current}'",
            hint=f"KubeCluster always uses the current context: kubectl config use-context "
            f"{profile.context}",
        )


# ---------------------------------------------------------------------------- start


def create_cluster(
    profile: KubernetesProfile, security: ClusterSecurity, name: str | None = None
) -> Any:
    """Create the resources, wait for scheduler and minimum workers, return a KubeCluster.

    The KubeCluster does not delete the resources when closed (``shutdown_on_close=False``):
    the cluster outlives this process until ``teardown``. On any failure, the resources are
    deleted and the error says why (CRD missing, RBAC, unreachable, or the pods' events).
    """
    name = cluster_name(name or profile.name)
    namespace = profile.namespace
    _check_context(profile)
    docs = manifests(profile, security, name)
    api = _api(profile.context)
    try:
        created = _kind("DaskCluster")(_doc(docs, "DaskCluster"), api=api)
        created.create()
    except Exception as error:
        raise _api_error(error, f"creating DaskCluster '{name}'", namespace) from error
    try:
        owner = {
            "apiVersion": GROUP_VERSION,
            "kind": "DaskCluster",
            "name": name,
            "uid": created.metadata["uid"],
            "blockOwnerDeletion": True,
        }
        for doc in docs:
            if doc["kind"] == "Secret":
                doc["metadata"]["ownerReferences"] = [owner]
                _kind("Secret", "v1")(doc, api=api).create()
            elif doc["kind"] == "DaskWorkerGroup":
                _kind("DaskWorkerGroup")(doc, api=api).create()
        deadline = time.monotonic() + profile.start_timeout
        wanted = profile.adapt.minimum if profile.adapt else profile.workers
        _wait_for_pods(api, name, namespace, wanted, deadline)
        cluster = _connect(name, namespace, security, profile.start_timeout)
        if profile.adapt:
            cluster.adapt(minimum=profile.adapt.minimum, maximum=profile.adapt.maximum)
        return cluster
    except BaseException:
        _delete(api, name, namespace)
        raise


def _doc(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(doc for doc in docs if doc["kind"] == kind)


def _connect(name: str, namespace: str, security: ClusterSecurity, timeout: float) -> Any:
    """KubeCluster.from_name, for TLS with the cluster's certificates."""
    from clusterkit.backends.kubernetes.cluster import connect

    return connect(name, namespace, security, timeout)


@dataclass
class _PodView:
    name: str
    component: str
    phase: str
    ready: bool
    stage: str
    reason: str


def _pods(api: Any, name: str, namespace: str) -> list[_PodView]:
    """The cluster's pods with their stage (pending, scheduled, pulling, running, connected)."""
    import kr8s

    pods = list(
        kr8s.get(
            "pods", namespace=namespace, api=api, label_selector={"dask.org/cluster-name": name}
        )
    )
    events = _events(api, namespace, {p.name for p in pods})
    views = []
    for pod in pods:
        status = pod.raw.get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        ready = conditions.get("Ready", {}).get("status") == "True"
        reasons = [e["reason"] for e in events.get(pod.name, [])]
        warnings = [e["message"] for e in events.get(pod.name, []) if e.get("type") == "Warning"]
        phase = status.get("phase", "Pending")
        waiting = [
            c["state"]["waiting"]
            for c in status.get("containerStatuses", [])
            if "waiting" in c.get("state", {})
        ]
        if ready:
            stage = "connected"
        elif phase == "Running" and not waiting:
            stage = "running"
        elif waiting:
            stage = "running"
            warnings.append(f"{waiting[0].get('reason')}: {waiting[0].get('message', '')}")
        elif "Pulling" in reasons or "Pulled" in reasons:
            stage = "pulling"
        elif conditions.get("PodScheduled", {}).get("status") == "True" or "Scheduled" in reasons:
            stage = "scheduled"
        else:
            stage = "pending"
        unscheduled = conditions.get("PodScheduled", {})
        if unscheduled.get("status") == "False" and unscheduled.get("message"):
            warnings.append(unscheduled["message"])
        views.append(
            _PodView(
                pod.name,
                pod.labels.get("dask.org/component", "?"),
                phase,
                ready,
                stage,
                warnings[-1] if warnings else "",
            )
        )
    return views


def _events(api: Any, namespace: str, pods: set[str]) -> dict[str, list[dict[str, Any]]]:
    import kr8s

    found: dict[str, list[dict[str, Any]]] = {}
    for event in kr8s.get("events", namespace=namespace, api=api):
        involved = event.raw.get("involvedObject", {})
        if involved.get("kind") == "Pod" and involved.get("name") in pods:
            found.setdefault(involved["name"], []).append(event.raw)
    return found


def _wait_for_pods(api: Any, name: str, namespace: str, workers: int, deadline: float) -> None:
    """Until the scheduler pod is ready and ``workers`` worker pods run; else say why."""
    while True:
        pods = _pods(api, name, namespace)
        scheduler = [p for p in pods if p.component == "scheduler"]
        running = [
            p
            for p in pods
            if p.component == "worker"
            and p.phase == "Running"
            and p.stage in ("running", "connected")
            and not p.reason
        ]
        if scheduler and scheduler[0].ready and len(running) >= workers:
            return
        if time.monotonic() > deadline:
            raise _stuck(api, name, namespace, pods, workers, len(running))
        time.sleep(POLL)


def _stuck(
    api: Any, name: str, namespace: str, pods: list[_PodView], workers: int, running: int
) -> ClusterStartError:
    evidence = [f"{p.name}: {p.stage} ({p.phase}) {p.reason}".rstrip() for p in pods]
    blocked = [p for p in pods if p.reason]
    if not pods:
        phase = _cluster_phase(api, name, namespace)
        why = (
            "the DaskCluster was never actioned: is the dask operator running?"
            if not phase
            else f"the operator created no pods (DaskCluster phase {phase})"
        )
        return ClusterStartError(
            why,
            component="kubernetes",
            evidence=evidence,
            hint=INSTALL_OPERATOR if not phase else None,
        )
    if blocked:
        pod = blocked[0]
        return ClusterStartError(
            f"pod {pod.name} is {pod.stage}: {pod.reason}",
            component=pod.component,
            evidence=evidence,
        )
    return ClusterStartError(
        f"{running} of {workers} worker pods running before the start timeout",
        component="workers",
        evidence=evidence,
    )


def _cluster_phase(api: Any, name: str, namespace: str) -> str | None:
    try:
        cluster = _kind("DaskCluster").get(name, namespace=namespace, api=api)
    except Exception:
        return None
    return cluster.raw.get("status", {}).get("phase")


# ---------------------------------------------------------------------------- lifecycle hooks


def _delete(api: Any, name: str, namespace: str, timeout: float = 60) -> None:
    """Delete the DaskCluster and wait until its pods are gone."""
    import kr8s

    with contextlib.suppress(kr8s.NotFoundError):
        _kind("DaskCluster").get(name, namespace=namespace, api=api).delete()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = list(
            kr8s.get(
                "pods", namespace=namespace, api=api, label_selector={"dask.org/cluster-name": name}
            )
        )
        if not left:
            return
        time.sleep(POLL)
    logger.warning("pods of %s/%s still terminating after %.0fs", namespace, name, timeout)


def record_extra(cluster: Any, profile: KubernetesProfile) -> dict[str, Any]:
    """What the record must keep: the resource's name, namespace and kubeconfig context."""
    return {"name": cluster.name, "namespace": cluster.namespace, "context": profile.context}


def _where(record: ClusterRecord) -> tuple[str, str, str | None]:
    extra = record.extra or {}
    return (
        extra.get("name") or cluster_name(record.name),
        extra.get("namespace", "default"),
        extra.get("context"),
    )


def teardown(record: ClusterRecord) -> None:
    """``down``: delete the DaskCluster (everything it owns goes with it)."""
    name, namespace, context = _where(record)
    api = _api(context)
    try:
        _delete(api, name, namespace)
    except ClusterkitError:
        raise
    except Exception as error:
        raise _api_error(error, f"deleting DaskCluster '{name}'", namespace) from error


def teardown_cluster(cluster: Any) -> None:
    """Delete a cluster that failed to start (before any record exists)."""
    with _quiet():
        cluster.close()
    _delete(_api(), cluster.name, cluster.namespace)


def attach(record: ClusterRecord) -> Client:
    """A Client to a running DaskCluster, found by name (KubeCluster.from_name)."""
    from distributed import Client

    from clusterkit.security import ClusterSecurity

    name, namespace, _ = _where(record)
    security = ClusterSecurity.from_dict(record.security)
    cluster = _connect(name, namespace, security, 30)
    address = cluster.scheduler_address
    with _quiet():
        cluster.close()
    return Client(address, security=security.distributed(), set_as_default=False)


def scale(record: ClusterRecord, n: int) -> None:
    """Scale the default worker group (this ends adaptivity, as in KubeCluster.scale)."""
    from clusterkit.security import ClusterSecurity

    name, namespace, _ = _where(record)
    cluster = _connect(name, namespace, ClusterSecurity.from_dict(record.security), 30)
    try:
        cluster.scale(n)
    finally:
        with _quiet():
            cluster.close()


class _quiet:
    """Suppress errors of closing a handle (the resources themselves are unaffected)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        if exc[1] is not None:
            logger.debug("closing the KubeCluster handle: %s", exc[1])
        return True


def describe(target: Any, profile: KubernetesProfile | None = None) -> list[StatusRow]:
    """One row per pod: its stage (pending … connected) and, when stuck, the reason."""
    if hasattr(target, "extra"):
        name, namespace, context = _where(target)
    else:
        name, namespace, context = target.name, target.namespace, getattr(profile, "context", None)
    return [
        StatusRow(kind=f"pod/{p.component}", name=p.name, state=p.stage, detail=p.reason or p.phase)
        for p in _pods(_api(context), name, namespace)
    ]


def evidence(cluster: Any, profile: KubernetesProfile) -> list[str]:
    return [f"{row.name}: {row.state} {row.detail}" for row in describe(cluster, profile)]


def list_resources(context: str | None = None) -> list[dict[str, Any]]:
    """The DaskClusters this kubeconfig can see, in every namespace (for ``ls``)."""
    import kr8s

    api = _api(context)
    try:
        found = kr8s.get("daskclusters.kubernetes.dask.org", namespace=kr8s.ALL, api=api)
        return [
            {
                "name": c.name,
                "namespace": c.namespace,
                "phase": c.raw.get("status", {}).get("phase", "?"),
                "managed": c.labels.get("app.kubernetes.io/managed-by") == "clusterkit",
            }
            for c in found
        ]
    except Exception as error:
        raise _api_error(error, "listing DaskClusters", "*") from error


# ---------------------------------------------------------------------------- doctor


def doctor(profile: KubernetesProfile, security: ClusterSecurity) -> list[Check]:
    """Context reachable, CRD installed, RBAC allowed, GPU nodes allocatable."""
    checks: list[Check] = []
    try:
        api = _api(profile.context)
        version = api.version()
        checks.append(
            Check(
                "kubernetes API reachable",
                True,
                f"{version.get('gitVersion', '?')} at {api.auth.server}",
            )
        )
    except Exception as error:
        checks.append(
            Check(
                "kubernetes API reachable",
                False,
                str(error).splitlines()[0],
                "check `kubectl cluster-info`, KUBECONFIG and the context",
            )
        )
        return checks
    checks.append(_crd_check(api, profile.namespace))
    review = _kind("SelfSubjectAccessReview", "authorization.k8s.io/v1", namespaced=False)
    for verb, resource, group in (
        ("create", "daskclusters", "kubernetes.dask.org"),
        ("list", "pods", ""),
        ("get", "services", ""),
    ):
        try:
            obj = review(
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SelfSubjectAccessReview",
                    "metadata": {},
                    "spec": {
                        "resourceAttributes": {
                            "namespace": profile.namespace,
                            "verb": verb,
                            "resource": resource,
                            "group": group,
                        }
                    },
                },
                api=api,
            )
            obj.create()
            allowed = bool(obj.raw.get("status", {}).get("allowed"))
            detail = f"{verb} {resource} in {profile.namespace}"
        except Exception as error:
            allowed, detail = False, str(error).splitlines()[0]
        checks.append(
            Check(
                f"RBAC: {verb} {resource}",
                allowed,
                detail,
                ""
                if allowed
                else f"grant {verb} on {resource} in namespace "
                f"'{profile.namespace}' (Role + RoleBinding)",
            )
        )
    checks.append(_gpu_check(api, profile))
    return checks


def _crd_check(api: Any, namespace: str) -> Check:
    """Listing DaskClusters answers 404 when the CRD is missing (discovery may be cached)."""
    name = "DaskCluster CRD installed"
    try:
        for _ in _kind("DaskCluster").list(namespace=namespace, api=api):
            break
    except Exception as error:
        found = _api_error(error, "listing DaskClusters", namespace)
        if "CRD missing" in found.message:
            return Check(name, False, "no daskclusters resource (404)", INSTALL_OPERATOR)
        if "forbidden" not in found.message:
            return Check(name, False, found.message, found.hint or "")
    return Check(name, True, GROUP_VERSION)


def _gpu_check(api: Any, profile: KubernetesProfile) -> Check:
    import kr8s

    wanted = max([profile.worker.gpus, *(g.worker.gpus for g in profile.worker_groups)])
    if not wanted:
        return Check("GPU nodes allocatable", True, "no GPU asked for")
    best = 0
    for node in kr8s.get("nodes", api=api):
        allocatable = node.raw.get("status", {}).get("allocatable", {})
        best = max(best, int(allocatable.get("nvidia.com/gpu", "0") or 0))
    ok = best >= wanted
    return Check(
        "GPU nodes allocatable",
        ok,
        f"largest node offers {best} nvidia.com/gpu, a worker needs {wanted}",
        "" if ok else "add GPU nodes with the NVIDIA device plugin (or lower worker.gpus)",
    )


BACKEND = sys.modules[__name__]
