"""Kubernetes API access for the backend: kr8s handles, object kinds, errors with the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clusterkit.backends.kubernetes.manifest import GROUP_VERSION
from clusterkit.errors import BadInput, ClusterkitError

if TYPE_CHECKING:
    from clusterkit.schema import KubernetesProfile

INSTALL_OPERATOR = (
    "install the operator: helm install --repo https://helm.dask.org --create-namespace "
    "-n dask-operator --generate-name dask-kubernetes-operator"
)


def api_handle(context: str | None = None) -> Any:
    import kr8s

    try:
        return kr8s.api(context=context) if context else kr8s.api()
    except Exception as error:  # kubeconfig missing or unreadable
        raise ClusterkitError(
            f"no usable Kubernetes configuration: {error}",
            hint="set KUBECONFIG or create ~/.kube/config",
        ) from None


def kind(kind: str, version: str = GROUP_VERSION, namespaced: bool = True) -> Any:
    import kr8s.objects

    return kr8s.objects.new_class(f"{kind}.{version}", asyncio=False, namespaced=namespaced)


def api_error(error: BaseException, what: str, namespace: str) -> ClusterkitError:
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


def check_context(profile: KubernetesProfile) -> None:
    if not profile.context:
        return
    current = api_handle().auth.active_context
    if current != profile.context:
        raise BadInput(
            f"profile '{profile.name}' names context '{profile.context}', the kubeconfig's "
            f"current context is '{current}'",
            hint=f"KubeCluster always uses the current context: kubectl config use-context "
            f"{profile.context}",
        )
