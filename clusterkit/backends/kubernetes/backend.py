"""Kubernetes: a DaskCluster run by the dask-kubernetes operator, driven through KubeCluster.

The cluster lives in the API server (DETACHED): ``up`` creates the resources, the start path
waits for the minimum workers, the record keeps name, namespace and context, and ``down``
deletes the DaskCluster (its Deployments, Services, worker groups and Secret go with it). An
embedded cluster (``get_client``) is deleted when its owner ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from clusterkit.backends.base import Backend, Capability, Check, Requirement, StatusRow
from clusterkit.backends.kubernetes import pods
from clusterkit.backends.kubernetes.api import api_error, api_handle, check_context, kind
from clusterkit.backends.kubernetes.manifest import (
    GROUP_VERSION,
    cluster_name,
    manifests,
    validate_manifest,
)
from clusterkit.errors import ClusterkitError
from clusterkit.schema import KubernetesProfile

if TYPE_CHECKING:
    from distributed import Client

    from clusterkit.security import ClusterSecurity
    from clusterkit.state import ClusterRecord

__all__ = ["KubernetesBackend", "validate_manifest"]

logger = logging.getLogger(__name__)


def render(profile: KubernetesProfile, security: ClusterSecurity) -> str:
    """The manifests (Secret, DaskCluster, DaskWorkerGroups, DaskAutoscaler) as YAML."""
    import yaml

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    docs = manifests(profile, security, cluster_name(profile.name))
    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False, default_flow_style=False)


def create_resources(profile: KubernetesProfile, security: ClusterSecurity, name: str) -> Any:
    """Create the resources, wait for the scheduler pod, return a KubeCluster handle.

    The handle does not delete the resources when closed (``shutdown_on_close=False``): the
    cluster outlives this process until ``teardown`` or ``destroy``. Waiting for the workers is
    the start path's job. On any failure here the resources are deleted and the error says why
    (CRD missing, RBAC, unreachable, or the pods' events).
    """
    namespace = profile.namespace
    check_context(profile)
    docs = manifests(profile, security, name)
    api = api_handle(profile.context)
    try:
        created = kind("DaskCluster")(_doc(docs, "DaskCluster"), api=api)
        created.create()
    except Exception as error:
        raise api_error(error, f"creating DaskCluster '{name}'", namespace) from error
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
                kind("Secret", "v1")(doc, api=api).create()
            elif doc["kind"] == "DaskWorkerGroup":
                kind("DaskWorkerGroup")(doc, api=api).create()
        deadline = time.monotonic() + profile.start_timeout
        pods.wait_for_pods(api, name, namespace, 0, deadline)
        return _connect(name, namespace, security, profile.start_timeout)
    except BaseException:
        delete(api, name, namespace)
        raise


def _doc(docs: list[dict[str, Any]], kind_name: str) -> dict[str, Any]:
    return next(doc for doc in docs if doc["kind"] == kind_name)


def _connect(name: str, namespace: str, security: ClusterSecurity, timeout: float) -> Any:
    """KubeCluster.from_name, for TLS with the cluster's certificates."""
    from clusterkit.backends.kubernetes.cluster import connect

    return connect(name, namespace, security, timeout)


def delete(api: Any, name: str, namespace: str, timeout: float = 60) -> None:
    """Delete the DaskCluster; return once it and its pods are gone.

    The operator's finalizer holds the DaskCluster until its delete handler ran, and the
    garbage collector removes the pods after it, so both are waited for.
    """
    import kr8s

    with contextlib.suppress(kr8s.NotFoundError):
        kind("DaskCluster").get(name, namespace=namespace, api=api).delete()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _remaining(api, name, namespace)
        if not left:
            return
        time.sleep(pods.POLL)
    logger.warning("%s of %s/%s still terminating after %.0fs", left, namespace, name, timeout)


def _remaining(api: Any, name: str, namespace: str) -> str:
    """What of the cluster still exists, in words ('' when nothing)."""
    import kr8s

    try:
        kind("DaskCluster").get(name, namespace=namespace, api=api)
        return "the DaskCluster"
    except kr8s.NotFoundError:
        pass
    selector = {"dask.org/cluster-name": name}
    left = list(kr8s.get("pods", namespace=namespace, api=api, label_selector=selector))
    return f"{len(left)} pods" if left else ""


def _where(record: ClusterRecord) -> tuple[str, str, str | None]:
    extra = record.extra or {}
    return (
        extra.get("name") or cluster_name(record.name),
        extra.get("namespace", "default"),
        extra.get("context"),
    )


@contextlib.contextmanager
def _handle(record: ClusterRecord, timeout: float = 30) -> Any:
    """A KubeCluster handle on a record's DaskCluster, closed (never deleting) afterwards."""
    from clusterkit.security import ClusterSecurity

    name, namespace, _ = _where(record)
    try:
        cluster = _connect(
            name, namespace, ClusterSecurity.from_dict(record.security).client_only(), timeout
        )
    except TimeoutError as error:
        raise ClusterkitError(
            f"cluster '{record.name}' does not answer: {error}",
            hint=f"`clusterkit status {record.name}` shows its pods; "
            f"`clusterkit down {record.name}` removes it",
        ) from None
    try:
        yield cluster
    finally:
        _close_handle(cluster)


def _close_handle(cluster: Any) -> None:
    """Close a KubeCluster handle; its errors do not concern the resources themselves."""
    try:
        cluster.close()
    except Exception as error:
        logger.debug("closing the KubeCluster handle: %s", error)


def _rows(api: Any, name: str, namespace: str) -> list[StatusRow]:
    return [
        StatusRow(kind=f"pod/{p.component}", name=p.name, state=p.stage, detail=p.reason or p.phase)
        for p in pods.pod_views(api, name, namespace)
    ]


class KubernetesBackend(Backend):
    """A DaskCluster through the dask-kubernetes operator, with dask-cuda workers for GPUs."""

    NAME = "kubernetes"
    Profile = KubernetesProfile
    CAPABILITIES = frozenset(
        {Capability.GPU, Capability.TLS, Capability.SCALE, Capability.ADAPT, Capability.DETACHED}
        | {Capability.REMOTE}
    )
    REQUIRES = (Requirement("dask_kubernetes", "dask-kubernetes", "kubernetes"),)

    def render(self, profile: KubernetesProfile, security: ClusterSecurity) -> str:
        return render(profile, security)

    def create(self, profile: KubernetesProfile, security: ClusterSecurity, *, name: str) -> Any:
        return create_resources(profile, security, cluster_name(name))

    def evidence(self, cluster: Any, profile: KubernetesProfile) -> list[str]:
        """Why the pods are not workers yet: the first line names the stuck pod and reason."""
        api = api_handle(profile.context)
        views = pods.pod_views(api, cluster.name, cluster.namespace)
        running = sum(1 for p in views if p.component == "worker" and p.stage == "connected")
        why = pods.stuck(api, cluster.name, cluster.namespace, views, profile.min_workers, running)
        return [why.message, *why.evidence]

    def destroy(self, cluster: Any, profile: KubernetesProfile) -> None:
        """Close the handle and delete the DaskCluster in the profile's context."""
        _close_handle(cluster)
        delete(api_handle(profile.context), cluster.name, cluster.namespace)

    def own(self, cluster: Any, profile: KubernetesProfile) -> None:
        """Closing the handle deletes the DaskCluster (KubeCluster's own shutdown_on_close)."""
        cluster.shutdown_on_close = True

    def release(self, cluster: Any, profile: KubernetesProfile) -> None:
        _close_handle(cluster)

    def record_extra(self, cluster: Any, profile: KubernetesProfile) -> dict[str, Any]:
        return {"name": cluster.name, "namespace": cluster.namespace, "context": profile.context}

    def describe(self, cluster: Any, profile: KubernetesProfile) -> list[StatusRow]:
        """One row per pod: its stage (pending … connected) and, when stuck, the reason."""
        return _rows(api_handle(profile.context), cluster.name, cluster.namespace)

    def doctor(self, profile: KubernetesProfile, security: ClusterSecurity) -> list[Check]:
        from clusterkit.backends.kubernetes.doctor import doctor

        return doctor(profile, security)

    def attach(self, record: ClusterRecord, *, timeout: float) -> Client:
        """A Client to a running DaskCluster, found by name (KubeCluster.from_name)."""
        from distributed import Client

        from clusterkit.security import ClusterSecurity

        with _handle(record, timeout) as cluster:
            address = cluster.scheduler_address
        security = ClusterSecurity.from_dict(record.security).client_only()
        return Client(
            address, security=security.distributed(), timeout=timeout, set_as_default=False
        )

    def teardown(self, record: ClusterRecord) -> None:
        """``down``: delete the DaskCluster (everything it owns goes with it)."""
        name, namespace, context = _where(record)
        try:
            delete(api_handle(context), name, namespace)
        except ClusterkitError:
            raise
        except Exception as error:
            raise api_error(error, f"deleting DaskCluster '{name}'", namespace) from error

    def scale_record(self, record: ClusterRecord, n: int) -> None:
        """Scale the default worker group (this ends adaptivity, as in KubeCluster.scale)."""
        with _handle(record) as cluster:
            cluster.scale(n)

    def describe_record(self, record: ClusterRecord) -> list[StatusRow]:
        name, namespace, context = _where(record)
        return _rows(api_handle(context), name, namespace)

    def list_resources(self) -> list[dict[str, Any]]:
        """The DaskClusters this kubeconfig can see, in every namespace (for ``ls``)."""
        import kr8s

        api = api_handle()
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
            raise api_error(error, "listing DaskClusters", "*") from error
