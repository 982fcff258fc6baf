"""Doctor checks of a kubernetes profile: API reachable, CRD installed, RBAC allowed, GPU nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clusterkit.backends.base import Check
from clusterkit.backends.kubernetes.api import INSTALL_OPERATOR, api_error, api_handle, kind
from clusterkit.backends.kubernetes.manifest import GROUP_VERSION

if TYPE_CHECKING:
    from clusterkit.schema import KubernetesProfile
    from clusterkit.security import ClusterSecurity


def doctor(profile: KubernetesProfile, security: ClusterSecurity) -> list[Check]:
    """Context reachable, CRD installed, RBAC allowed, GPU nodes allocatable."""
    checks: list[Check] = []
    try:
        api = api_handle(profile.context)
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
    checks.extend(_rbac_checks(api, profile.namespace))
    checks.append(_gpu_check(api, profile))
    return checks


def _rbac_checks(api: Any, namespace: str) -> list[Check]:
    """What SelfSubjectAccessReview says of the verbs the backend needs."""
    checks: list[Check] = []
    review = kind("SelfSubjectAccessReview", "authorization.k8s.io/v1", namespaced=False)
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
                            "namespace": namespace,
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
            detail = f"{verb} {resource} in {namespace}"
        except Exception as error:
            allowed, detail = False, str(error).splitlines()[0]
        checks.append(
            Check(
                f"RBAC: {verb} {resource}",
                allowed,
                detail,
                ""
                if allowed
                else f"grant {verb} on {resource} in namespace '{namespace}' (Role + RoleBinding)",
            )
        )
    return checks


def _crd_check(api: Any, namespace: str) -> Check:
    """Listing DaskClusters answers 404 when the CRD is missing (discovery may be cached)."""
    name = "DaskCluster CRD installed"
    try:
        for _ in kind("DaskCluster").list(namespace=namespace, api=api):
            break
    except Exception as error:
        found = api_error(error, "listing DaskClusters", namespace)
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
