"""DaskCluster manifests from a kubernetes profile, validated against the operator's CRDs."""

from __future__ import annotations

import base64
import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit import webauth
from clusterkit.errors import ProfileError
from clusterkit.schema import cuda
from clusterkit.security import CA_NAME, ROLE_FILES, operator_http_env

if TYPE_CHECKING:
    from clusterkit.schema import K8sResources, KubernetesProfile, WorkerGroup, WorkerSpec
    from clusterkit.security import ClusterSecurity

GROUP_VERSION = "kubernetes.dask.org/v1"
SCHEDULER_PORT = 8786
DASHBOARD_PORT = 8787
WORKER_DASHBOARD_PORT = 8788
TLS_MOUNT = "/etc/clusterkit/tls"
#: The web pages' gate, carried by the cluster's Secret: the stock Dask image has no clusterkit,
#: and Dask preloads a module from a file path as well as by name.
GATE_FILE = "clusterkit_webauth.py"
#: The scheduler's HTTP API, which the operator calls without the secret (scaling, retiring).
OPERATOR_PATHS = "/api/v1/"
#: The Kubernetes version built-in kinds are validated against (kubernetes-validate schemas).
K8S_VERSION = "1.30.0"
CRD_DIR = "deployment/helm/dask-kubernetes-operator/crds"
CRD_FILES = {
    "DaskCluster": "daskcluster.yaml",
    "DaskWorkerGroup": "daskworkergroup.yaml",
    "DaskAutoscaler": "daskautoscaler.yaml",
}


def cluster_name(name: str) -> str:
    """A DNS-1123 label from a profile or record name (the operator's own rule)."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-")
    return label or "clusterkit"


def _env(profile: KubernetesProfile, security: ClusterSecurity) -> list[dict[str, str]]:
    gate = webauth.remote_env(TLS_MOUNT if security.web_token_file else None)
    if gate:
        gate[webauth.OPEN_PATHS_ENV] = OPERATOR_PATHS
    merged = {**security.env, **gate, **profile.env}
    return [{"name": key, "value": str(value)} for key, value in merged.items()]


def _resources(base: K8sResources, gpus: int) -> dict[str, dict[str, str]]:
    requests = {k: str(v) for k, v in base.requests.items()}
    limits = {k: str(v) for k, v in base.limits.items()}
    if gpus:  # extended resources are requested through limits; the CRD wants strings
        limits.setdefault("nvidia.com/gpu", str(gpus))
    out: dict[str, dict[str, str]] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _tls_args(security: ClusterSecurity, role: str) -> list[str]:
    """``--tls-*`` flags naming the mounted files of ``role`` (scheduler or worker)."""
    if not security.tls:
        return []
    cert, key = ROLE_FILES[role]
    return [
        "--tls-ca-file",
        f"{TLS_MOUNT}/{CA_NAME}",
        "--tls-cert",
        f"{TLS_MOUNT}/{cert}",
        "--tls-key",
        f"{TLS_MOUNT}/{key}",
    ]


def _gate_args(security: ClusterSecurity) -> list[str]:
    """The preload of the web pages' gate, from the Secret (its secret's file by environment)."""
    return ["--preload", f"{TLS_MOUNT}/{GATE_FILE}"] if security.web_token_file else []


def _tls_volume(name: str, security: ClusterSecurity) -> dict[str, Any]:
    """The cluster's Secret (certificates, the web pages' secret and gate) as a volume."""
    if not security.server_files():
        return {}
    return {
        "volumes": [{"name": "tls", "secret": {"secretName": f"{name}-tls", "defaultMode": 0o400}}],
        "mounts": [{"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True}],
    }


def worker_args(
    profile: KubernetesProfile, spec: WorkerSpec, security: ClusterSecurity
) -> list[str]:
    """The worker command: dask-cuda's worker when GPUs are asked for, with the GPU resource."""
    command = ["dask", "cuda", "worker"] if spec.gpus else ["dask", "worker"]
    args = [
        *command,
        "--name",
        "$(DASK_WORKER_NAME)",
        "--nthreads",
        str(spec.threads),
        "--dashboard",
        "--dashboard-address",
        str(WORKER_DASHBOARD_PORT),
        "--death-timeout",
        f"{profile.death_timeout:g}s",
    ]
    if spec.memory != "auto":
        args += ["--memory-limit", str(spec.memory)]
    resources = dict(spec.resources)
    if spec.gpus:
        resources.setdefault("GPU", float(spec.gpus))
    if resources:
        args += ["--resources", " ".join(f"{k}={v:g}" for k, v in sorted(resources.items()))]
    if profile.protocol != "tcp":
        args += ["--protocol", profile.protocol]
    for module in profile.preload:
        args += ["--preload", module]
    if spec.gpus:
        args += cuda.worker_flags(profile.cuda)
    return args + _tls_args(security, "worker") + _gate_args(security)


def scheduler_args(profile: KubernetesProfile, security: ClusterSecurity) -> list[str]:
    args = [
        "dask",
        "scheduler",
        "--host",
        "0.0.0.0",
        "--port",
        str(SCHEDULER_PORT),
        "--dashboard-address",
        f":{DASHBOARD_PORT}",
    ]
    if profile.protocol != "tcp":
        args += ["--protocol", profile.protocol]
    for module in profile.preload:
        args += ["--preload", module]
    return args + _tls_args(security, "scheduler") + _gate_args(security)


def worker_spec(
    profile: KubernetesProfile,
    name: str,
    security: ClusterSecurity,
    replicas: int,
    group: WorkerGroup | None = None,
) -> dict[str, Any]:
    """The ``worker`` block of a DaskCluster or DaskWorkerGroup."""
    spec = group.worker if group else profile.worker
    env = _env(profile, security)
    env.append(
        {
            "name": "DASK_SCHEDULER_ADDRESS",
            "value": f"{security.scheme}://{name}-scheduler.{profile.namespace}"
            f".svc.cluster.local:{SCHEDULER_PORT}",
        }
    )
    container: dict[str, Any] = {
        "name": "worker",
        "image": (group.image if group and group.image else profile.image),
        "imagePullPolicy": profile.image_pull_policy,
        "args": worker_args(profile, spec, security),
        "env": env,
        "ports": [
            {"name": "http-dashboard", "containerPort": WORKER_DASHBOARD_PORT, "protocol": "TCP"}
        ],
    }
    resources = _resources(group.resources if group else profile.resources, spec.gpus)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {"containers": [container]}
    selector = profile.node_selector
    tolerations = profile.tolerations
    if group is not None and group.node_selector is not None:
        selector = group.node_selector
    if group is not None and group.tolerations is not None:
        tolerations = group.tolerations
    if selector:
        pod["nodeSelector"] = dict(selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    tls = _tls_volume(name, security)
    if tls:
        container["volumeMounts"] = tls["mounts"]
        pod["volumes"] = tls["volumes"]
    return {"replicas": replicas, "spec": pod}


def scheduler_spec(
    profile: KubernetesProfile, name: str, security: ClusterSecurity
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "scheduler",
        "image": profile.image,
        "imagePullPolicy": profile.image_pull_policy,
        "args": scheduler_args(profile, security),
        "env": _env(profile, security)
        + [{"name": k, "value": v} for k, v in operator_http_env(security).items()],
        "ports": [
            {"name": "tcp-comm", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
            {"name": "http-dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {
            "httpGet": {"port": "http-dashboard", "path": "/health"},
            "initialDelaySeconds": 0,
            "periodSeconds": 1,
            "timeoutSeconds": 300,
        },
        "livenessProbe": {
            "httpGet": {"port": "http-dashboard", "path": "/health"},
            "initialDelaySeconds": 15,
            "periodSeconds": 20,
        },
    }
    resources = _resources(profile.scheduler_resources, 0)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {"containers": [container]}
    tls = _tls_volume(name, security)
    if tls:
        container["volumeMounts"] = tls["mounts"]
        pod["volumes"] = tls["volumes"]
    return {
        "spec": pod,
        "service": {
            "type": profile.service_type,
            "selector": {"dask.org/cluster-name": name, "dask.org/component": "scheduler"},
            "ports": [
                {
                    "name": "tcp-comm",
                    "protocol": "TCP",
                    "port": SCHEDULER_PORT,
                    "targetPort": "tcp-comm",
                },
                {
                    "name": "http-dashboard",
                    "protocol": "TCP",
                    "port": DASHBOARD_PORT,
                    "targetPort": "http-dashboard",
                },
            ],
        },
    }


def _metadata(name: str, profile: KubernetesProfile) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": profile.namespace,
        "labels": {
            "app.kubernetes.io/managed-by": "clusterkit",
            "clusterkit.dev/profile": cluster_name(profile.name),
        },
    }


def daskcluster(profile: KubernetesProfile, security: ClusterSecurity, name: str) -> dict[str, Any]:
    """The DaskCluster resource (default worker group included)."""
    replicas = profile.adapt.minimum if profile.adapt else profile.workers
    spec: dict[str, Any] = {
        "worker": worker_spec(profile, name, security, replicas),
        "scheduler": scheduler_spec(profile, name, security),
    }
    if profile.idle_timeout:
        spec["idleTimeout"] = int(profile.idle_timeout)
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "DaskCluster",
        "metadata": _metadata(name, profile),
        "spec": spec,
    }


def worker_groups(
    profile: KubernetesProfile, security: ClusterSecurity, name: str
) -> list[dict[str, Any]]:
    """One DaskWorkerGroup per extra group (e.g. CPU workers beside GPU ones)."""
    return [
        {
            "apiVersion": GROUP_VERSION,
            "kind": "DaskWorkerGroup",
            "metadata": {**_metadata(f"{name}-{group.name}", profile)},
            "spec": {
                "cluster": name,
                "worker": worker_spec(profile, name, security, group.workers, group),
            },
        }
        for group in profile.worker_groups
    ]


def autoscaler(profile: KubernetesProfile, name: str) -> dict[str, Any] | None:
    if profile.adapt is None:
        return None
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "DaskAutoscaler",
        "metadata": _metadata(name, profile),
        "spec": {
            "cluster": name,
            "minimum": profile.adapt.minimum,
            "maximum": profile.adapt.maximum,
        },
    }


def tls_secret(profile: KubernetesProfile, security: ClusterSecurity, name: str) -> dict[str, Any]:
    """The scheduler's and workers' certificates, the web pages' secret and gate, as an Opaque
    Secret they mount (the client's key never leaves the machine that made it)."""
    data: dict[str, str] = {}
    files = security.server_files()
    if security.web_token_file:
        files.append((GATE_FILE, webauth.__file__))
    for key, path in files:
        file = Path(path)
        raw = file.read_bytes() if file.is_file() else f"<{path}>".encode()
        data[key] = base64.b64encode(raw).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(f"{name}-tls", profile),
        "data": data,
    }


def manifests(
    profile: KubernetesProfile, security: ClusterSecurity, name: str
) -> list[dict[str, Any]]:
    """Every object the cluster is made of, in creation order."""
    docs: list[dict[str, Any]] = []
    if security.server_files():
        docs.append(tls_secret(profile, security, name))
    docs.append(daskcluster(profile, security, name))
    docs += worker_groups(profile, security, name)
    scaler = autoscaler(profile, name)
    if scaler:
        docs.append(scaler)
    for doc in docs:
        validate_manifest(doc)
    return docs


# ---------------------------------------------------------------------------- validation


@functools.cache
def _crd_validator(kind: str) -> Any:
    import importlib.resources

    import jsonschema
    import yaml

    root = importlib.resources.files("dask_kubernetes.operator") / CRD_DIR
    crd = yaml.safe_load((root / CRD_FILES[kind]).read_text())
    return jsonschema.Draft7Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def _k8s_validate(obj: dict[str, Any], where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(p) for p in error.path)
        raise ProfileError(f"{where}: {path}: {error.message}") from None


def validate_manifest(obj: dict[str, Any]) -> None:
    """Raise ProfileError unless ``obj`` passes its CRD schema (dask kinds) or kubernetes-validate.

    For dask kinds, the embedded pod specs are also checked as Pods by kubernetes-validate.
    """
    kind = obj.get("kind", "")
    if kind not in CRD_FILES:
        _k8s_validate(obj, kind)
        return
    errors = sorted(_crd_validator(kind).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        path = ".".join(str(p) for p in first.absolute_path)
        raise ProfileError(f"{kind} {path}: {first.message}")
    spec = obj.get("spec", {})
    blocks = {"worker": spec.get("worker"), "scheduler": spec.get("scheduler")}
    for role, block in blocks.items():
        if isinstance(block, dict) and "spec" in block:
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "check"},
                "spec": block["spec"],
            }
            _k8s_validate(pod, f"{kind} spec.{role}.spec")
