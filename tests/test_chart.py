"""The Helm chart: lint, render, validate manifests, schema, TLS by default (generated CA and
certificates, kept across upgrades), NOTES profile, helm test, checkov."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.ops import (
    CHART,
    K8S_VERSION,
    checkov,
    documents,
    helm,
    template,
    tool,
    tool_env,
    write_values,
)

pytestmark = pytest.mark.chart

GPU = {
    "worker": {
        "replicas": 3,
        "gpus": 2,
        "threads": 4,
        "memoryLimit": "24GiB",
        "daskResources": {"FOO": 2},
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "gpu-type", "operator": "In", "values": ["a100"]}
                            ]
                        }
                    ]
                }
            }
        },
        "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
    },
    "env": {"NCCL_DEBUG": "WARN"},
}
TLS = {"protocol": "tls", "tls": {"secretName": "dask-tls"}}  # cert-manager's Secret
TCP = {"protocol": "tcp"}
OPERATOR = {"operator": {"enabled": True}}
CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu": GPU,
    "tls": TLS,
    "tcp": TCP,
    "ucx": {"protocol": "ucx"},
    "operator": OPERATOR,
    "operator-gpu-tls": {**GPU, **TLS, **OPERATOR},
    "readers-loadbalancer": {
        "tls": {
            "clientReaders": [
                {"kind": "Group", "name": "lab"},
                {"kind": "ServiceAccount", "name": "nb"},
            ]
        },
        "scheduler": {"service": {"type": "LoadBalancer"}},
    },
}
GENERATED_SECRETS = ["demo-ca", "demo-scheduler-tls", "demo-worker-tls", "demo-client-tls"]


def render(tmp_path: Path, values: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    return documents(template(write_values(tmp_path, values), **kwargs).stdout)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    return pod_spec(doc)["containers"][0]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in by_kind(docs, kind) if d["metadata"]["name"] == name)


def secret_files(secret: dict[str, Any]) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


@functools.cache
def crd_validator() -> Any:
    import jsonschema

    crd = yaml.safe_load(
        (
            importlib.resources.files("dask_kubernetes.operator")
            / "deployment/helm/dask-kubernetes-operator/crds/daskcluster.yaml"
        ).read_text()
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema)


def test_helm_lint_strict(tmp_path: Path) -> None:
    for name, values in CASES.items():
        result = helm("lint", "--strict", str(CHART), "-f", str(write_values(tmp_path, values)))
        assert "0 chart(s) failed" in result.stdout, (name, result.stdout)


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifests_valid(case: str, tmp_path: Path) -> None:
    """Every built-in kind passes kubernetes-validate (strict); DaskCluster passes its CRD."""
    import kubernetes_validate

    values = CASES[case]
    docs = render(tmp_path, values)
    kinds = sorted(d["kind"] for d in docs)
    operator = case.startswith("operator")
    expected = ["DaskCluster"] if operator else ["Deployment", "Deployment", "Service"]
    expected += ["NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "Pod", "Secret"]  # web
    if values.get("protocol", "tls") == "tls":
        expected += ["Role"] + (["RoleBinding"] if "clientReaders" in values.get("tls", {}) else [])
        if not values.get("tls", {}).get("secretName"):
            expected += ["Secret"] * 4
    assert kinds == sorted(expected)
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"]["namespace"] == "dask", where
        if doc["kind"] == "DaskCluster":
            errors = [(list(e.absolute_path), e.message) for e in crd_validator().iter_errors(doc)]
            assert errors == [], where
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{case}: {where}: {error.message} at {list(error.path)}")


def test_default_is_cpu_tls_and_hardened(tmp_path: Path) -> None:
    docs = render(tmp_path, {})
    worker = named(docs, "Deployment", "demo-worker")
    c = container(worker)
    assert c["args"][:3] == ["dask", "worker", "tls://demo-scheduler.dask.svc.cluster.local:8786"]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert "--resources" not in c["args"]
    pod = worker["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    for doc in [*by_kind(docs, "Deployment"), *by_kind(docs, "Pod")]:
        sc = container(doc)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in container(doc)["volumeMounts"]}
        assert "/tmp" in mounts, doc["metadata"]["name"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/worker-space"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["port"] == "http-dashboard"
    service = by_kind(docs, "Service")[0]
    assert {p["port"] for p in service["spec"]["ports"]} == {8786, 8787}
    assert service["spec"]["type"] == "ClusterIP"
    assert by_kind(docs, "Pod")[0]["metadata"]["annotations"]["helm.sh/hook"] == "test"


def test_default_requires_tls_from_generated_secrets(tmp_path: Path) -> None:
    """Scheduler, workers and the helm test pod each mount their own generated Secret (read-only,
    mode 0400) and pass only file paths; scheduler and workers require encryption."""
    docs = render(tmp_path, {})
    mounted = {}
    for doc in [*by_kind(docs, "Deployment"), *by_kind(docs, "Pod")]:
        name = doc["metadata"]["name"]
        volumes = [v for v in pod_spec(doc)["volumes"] if "secret" in v and v["name"] != "web"]
        (volume,) = volumes  # beside it, the web pages' secret (test_every_dask_process_...)
        assert volume["secret"]["defaultMode"] == 0o400, name
        mounted[name] = volume["secret"]["secretName"]
        (mount,) = [m for m in container(doc)["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": "tls", "mountPath": "/etc/dask/tls", "readOnly": True}, name
    assert mounted == {
        "demo-scheduler": "demo-scheduler-tls",
        "demo-worker": "demo-worker-tls",
        "demo-test-connection": "demo-client-tls",
    }
    scheduler_args = container(named(docs, "Deployment", "demo-scheduler"))["args"]
    assert scheduler_args[scheduler_args.index("--protocol") + 1] == "tls"
    for deployment in by_kind(docs, "Deployment"):
        c = container(deployment)
        args = c["args"]
        assert args[args.index("--tls-ca-file") + 1] == "/etc/dask/tls/ca.crt"
        assert args[args.index("--tls-cert") + 1] == "/etc/dask/tls/tls.crt"
        assert args[args.index("--tls-key") + 1] == "/etc/dask/tls/tls.key"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
    (test_pod,) = by_kind(docs, "Pod")
    env = {e["name"]: e.get("value") for e in container(test_pod)["env"]}
    assert env["DASK_PROTOCOL"] == "tls" and env["TLS_DIR"] == "/etc/dask/tls"
    assert "require_encryption=True" in container(test_pod)["command"][-1]


def test_no_key_material_in_args_or_env(tmp_path: Path) -> None:
    """Keys (and certificates) reach the pods only as files mounted from Secrets."""
    docs = render(tmp_path, {})
    material: set[str] = set()  # the Secrets' values, base64 and decoded, and each PEM line
    for secret in by_kind(docs, "Secret"):
        for value in secret["data"].values():
            pem = base64.b64decode(value).decode()
            material |= {value, *(line for line in pem.splitlines() if len(line) > 40)}
    assert len(material) > 4 * 8
    for doc in [*by_kind(docs, "Deployment"), *by_kind(docs, "Pod")]:
        name = doc["metadata"]["name"]
        c = container(doc)
        assert "envFrom" not in c, name
        exposed = [*c.get("command", []), *c.get("args", []), *map(str, c["env"])]
        text = "\n".join(exposed)
        assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text, name
        assert "secretKeyRef" not in text, name
        assert not [line for line in material if line in text], name


def test_generated_ca_signs_a_certificate_per_component(tmp_path: Path) -> None:
    """One CA; scheduler, worker and client certificates each with its own key, signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    docs = render(tmp_path, {})
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    assert secrets.pop("demo-web")["type"] == "Opaque"  # the web pages' secret (no key)
    assert sorted(secrets) == sorted(GENERATED_SECRETS)
    assert all(s["type"] == "kubernetes.io/tls" for s in secrets.values())
    ca_files = secret_files(secrets.pop("demo-ca"))
    ca = x509.load_pem_x509_certificate(ca_files["tls.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    public_keys = set()
    for name, secret in secrets.items():
        files = secret_files(secret)
        assert sorted(files) == ["ca.crt", "tls.crt", "tls.key"], name
        assert files["ca.crt"] == ca_files["tls.crt"], name
        cert = x509.load_pem_x509_certificate(files["tls.crt"])
        cert.verify_directly_issued_by(ca)
        key = serialization.load_pem_private_key(files["tls.key"], password=None)
        own = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assert own == cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ), name
        public_keys.add(own)
        component = name.removeprefix("demo-").removesuffix("-tls")
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        assert cn == f"demo-{component}"
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH in usage, name
        assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in usage, name
    assert len(public_keys) == 3  # no shared keys
    scheduler = x509.load_pem_x509_certificate(
        secret_files(secrets["demo-scheduler-tls"])["tls.crt"]
    )
    names = scheduler.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "demo-scheduler.dask.svc.cluster.local" in names.get_values_for_type(x509.DNSName)


def test_client_secret_is_guarded_by_a_role(tmp_path: Path) -> None:
    docs = render(tmp_path, CASES["readers-loadbalancer"])
    named(docs, "Secret", "demo-client-tls")
    role = named(docs, "Role", "demo-client-tls-reader")
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["demo-client-tls"],
            "verbs": ["get"],
        }
    ]
    binding = named(docs, "RoleBinding", "demo-client-tls-reader")
    assert binding["roleRef"]["name"] == "demo-client-tls-reader"
    assert binding["subjects"] == [
        {"kind": "Group", "name": "lab", "apiGroup": "rbac.authorization.k8s.io"},
        {"kind": "ServiceAccount", "name": "nb", "namespace": "dask"},
    ]
    # the dashboard has no authentication: a LoadBalancer carries the scheduler port alone
    service = named(docs, "Service", "demo-scheduler")
    assert [p["port"] for p in service["spec"]["ports"]] == [8786]


def test_network_policy_admits_clients_from_the_namespace_only(tmp_path: Path) -> None:
    docs = render(tmp_path, {})
    scheduler = named(docs, "NetworkPolicy", "demo-scheduler")
    rules = scheduler["spec"]["ingress"]
    client_rule = next(r for r in rules if "ports" in r)
    assert {p["port"] for p in client_rule["ports"]} == {8786, 8787}
    # a peer with only podSelector {} is every pod of the policy's (the release's) namespace
    assert client_rule["from"] == [{"podSelector": {}}]
    assert all(r.get("from") for r in rules), "no rule may admit every source"
    worker = named(docs, "NetworkPolicy", "demo-worker")
    peers = [peer for r in worker["spec"]["ingress"] for peer in r["from"]]
    assert all(set(peer) == {"podSelector"} for peer in peers), peers


def test_tcp_still_renders(tmp_path: Path) -> None:
    """Explicit tcp: no certificates, and the namespace-only NetworkPolicy is all that guards
    the scheduler."""
    docs = render(tmp_path, TCP)
    client_rule = next(
        r for r in named(docs, "NetworkPolicy", "demo-scheduler")["spec"]["ingress"] if "ports" in r
    )
    assert client_rule["from"] == [{"podSelector": {}}]
    assert [s["metadata"]["name"] for s in by_kind(docs, "Secret")] == ["demo-web"]
    assert by_kind(docs, "Role") == []
    for doc in [*by_kind(docs, "Deployment"), *by_kind(docs, "Pod")]:
        c = container(doc)
        assert "--tls-key" not in c.get("args", []), doc["metadata"]["name"]
        secrets = [v["secret"]["secretName"] for v in pod_spec(doc)["volumes"] if "secret" in v]
        assert secrets in ([], ["demo-web"])  # no certificate: the web pages' secret at most
        assert "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION" not in {e["name"] for e in c["env"]}
    worker = named(docs, "Deployment", "demo-worker")
    assert container(worker)["args"][2] == "tcp://demo-scheduler.dask.svc.cluster.local:8786"


def test_gpu_workers_run_dask_cuda(tmp_path: Path) -> None:
    docs = render(tmp_path, GPU)
    worker = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "demo-worker")
    c = container(worker)
    args = c["args"]
    assert args[:3] == ["dask", "cuda", "worker"]
    assert args[args.index("--resources") + 1] == "GPU=1,FOO=2"
    assert args[args.index("--nthreads") + 1] == "4"
    assert args[args.index("--memory-limit") + 1] == "24GiB"
    # helm merges the chart defaults under the given maps (cpu: "2" stays)
    assert c["resources"]["limits"] == {"cpu": "2", "memory": "64Gi", "nvidia.com/gpu": "2"}
    assert c["resources"]["requests"] == {"cpu": "8", "memory": "32Gi"}
    pod = worker["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == GPU["worker"]["nodeSelector"]
    assert pod["tolerations"] == GPU["worker"]["tolerations"]
    assert pod["affinity"] == GPU["worker"]["affinity"]
    assert worker["spec"]["replicas"] == 3
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in c["env"]


def test_tls_mounts_the_secret_everywhere(tmp_path: Path) -> None:
    docs = render(tmp_path, TLS)
    for doc in [*by_kind(docs, "Deployment"), *by_kind(docs, "Pod")]:
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
        secrets = [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v]
        web = ["demo-web"] if doc["kind"] == "Deployment" else []  # the test pod needs none
        assert secrets == ["dask-tls", *web], doc["metadata"]["name"]
    for deployment in by_kind(docs, "Deployment"):
        args = container(deployment)["args"]
        assert args[args.index("--tls-ca-file") + 1] == "/etc/dask/tls/ca.crt"
        assert args[args.index("--tls-key") + 1] == "/etc/dask/tls/tls.key"
    worker = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "demo-worker")
    assert container(worker)["args"][2] == "tls://demo-scheduler.dask.svc.cluster.local:8786"


def test_operator_mode_renders_a_daskcluster(tmp_path: Path) -> None:
    docs = render(tmp_path, CASES["operator-gpu-tls"])
    (cluster,) = by_kind(docs, "DaskCluster")
    assert cluster["apiVersion"] == "kubernetes.dask.org/v1"
    worker = cluster["spec"]["worker"]
    assert worker["replicas"] == 3
    c = worker["spec"]["containers"][0]
    assert c["args"][:4] == [
        "dask",
        "cuda",
        "worker",
        "tls://demo-scheduler.dask.svc.cluster.local:8786",
    ]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    service = cluster["spec"]["scheduler"]["service"]
    assert service["selector"] == {
        "dask.org/cluster-name": "demo",
        "dask.org/component": "scheduler",
    }


def test_rendered_args_are_accepted_by_the_real_clis(tmp_path: Path) -> None:
    """Parse the rendered command lines with dask's own CLIs (``--help`` stops before running)."""
    bindir = Path(sys.executable).parent
    for values in (GPU | TLS, {"worker": {"preload": ["mymod"], "daskResources": {"MEM": 1}}}):
        docs = render(tmp_path, values)
        for deployment in by_kind(docs, "Deployment"):
            args = [a.replace("$(POD_NAME)", "pod-0") for a in container(deployment)["args"]]
            result = subprocess.run(
                [str(bindir / args[0]), *args[1:], "--help"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert result.returncode == 0, (args, result.stderr[-1500:])


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"worker": {"replicas": -1}}, "replicas"),
        ({"worker": {"replicas": 5000}}, "replicas"),
        ({"protocol": "udp"}, "protocol"),
        ({"worker": {"gpus": "2"}}, "gpus"),
        ({"worker": {"gpus": 17}}, "gpus"),
        ({"worker": {"threads": 0}}, "threads"),
        ({"worker": {"memoryLimit": "lots"}}, "memoryLimit"),
        ({"worker": {"resources": {"limits": {"memory": "8 gigs"}}}}, "memory"),
        ({"worker": {"tolerations": [{"key": "k", "operator": "Maybe"}]}}, "operator"),
        ({"image": {"tag": ""}}, "tag"),
        ({"scheduler": {"port": 70000}}, "port"),
        ({"scheduler": {"service": {"type": "Ingress"}}}, "type"),
        ({"fullnameOverride": "Not_A_Label"}, "fullnameOverride"),
        ({"workers": 3}, "workers"),
        ({"tls": {"validityDays": 0}}, "validityDays"),
        ({"tls": {"clientReaders": [{"kind": "Role", "name": "x"}]}}, "kind"),
        ({"networkPolicy": {"clientFrom": [{"anywhere": True}]}}, "anywhere"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], field: str, tmp_path: Path) -> None:
    result = template(write_values(tmp_path, values), check=False)
    assert result.returncode != 0, f"accepted {values}"
    assert "schema" in result.stderr.lower(), result.stderr
    assert field in result.stderr, result.stderr


def notes(tmp_path: Path, values: dict[str, Any], namespace: str = "dask") -> str:
    """NOTES.txt as `helm install` would print it (helm template skips NOTES)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "NOTES.in") . | toJson }}}\n'
    )
    (chart / "NOTES.in").write_text((CHART / "templates" / "NOTES.txt").read_text())
    docs = documents(
        template(write_values(tmp_path, values), chart=chart, namespace=namespace).stdout
    )
    return next(d for d in docs if d["kind"] == "ConfigMap")["data"]["notes"]


def profile_of(text: str) -> dict[str, Any]:
    block = text.split("# --- clusterkit profile:", 1)[1].split("\n# ---", 1)[0]
    return yaml.safe_load(block.split("\n", 1)[1])


def test_notes_print_an_address_profile(tmp_path: Path) -> None:
    from clusterkit.schema import AddressProfile

    text = notes(tmp_path, GPU, namespace="research")
    model = AddressProfile.model_validate(profile_of(text))
    assert model.address == "tls://demo-scheduler.research.svc.cluster.local:8786"
    assert model.workers == 6  # 3 pods x 2 GPUs, one dask-cuda worker per GPU
    assert model.tls is not None and model.tls.key_file.endswith("/demo/tls.key")
    # the generated client Secret, fetched into owner-only files the profile names
    assert "Secret research/demo-client-tls" in text
    fetch = [line.strip() for line in text.splitlines() if "get secret demo-client-tls" in line]
    assert fetch == [
        "(umask 077 && kubectl -n research get secret demo-client-tls -o jsonpath="
        f"'{{.data.{jsonpath_key}}}' | base64 -d > ~/.config/clusterkit/tls/demo/{key})"
        for key, jsonpath_key in (
            ("ca.crt", r"ca\.crt"),
            ("tls.crt", r"tls\.crt"),
            ("tls.key", r"tls\.key"),
        )
    ]
    assert "(umask 077 && mkdir -p ~/.config/clusterkit/tls/demo)" in text
    assert "demo-client-tls-reader" in text
    assert "anyone who can reach" not in text

    text = notes(tmp_path / "cert-manager", TLS)
    assert "get secret dask-tls" in text and "Secret dask/dask-tls:" in text

    text = notes(tmp_path / "tcp", {**GPU, **TCP})
    model = AddressProfile.model_validate(profile_of(text))
    assert model.address == "tcp://demo-scheduler.dask.svc.cluster.local:8786"
    assert model.tls is None
    (warning,) = [line for line in text.splitlines() if "anyone who can reach" in line]
    assert warning.startswith("WARNING: protocol tcp") and "run code as the workers" in warning


def stranger_files(directory: Path) -> Path:
    """A client certificate and key of a CA that is not the release's, in the Secret's layout:
    what a pod without the client Secret could present at best."""
    from clusterkit.security import generate_tls

    own = generate_tls(directory / "made")
    directory.mkdir(exist_ok=True)
    for name, path in (
        ("ca.crt", own.ca_file),
        ("tls.crt", own.cert_file),
        ("tls.key", own.key_file),
    ):
        (directory / name).write_bytes(Path(str(path)).read_bytes())
    return directory


def web_gate(secrets: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    """The scheduler's preload as the chart's pods run it: the gate and the secret from the
    release's web Secret, mounted (here: written) where its environment names them."""
    web = [s for s in secrets if s["metadata"]["name"].endswith("-web")]
    if not web:
        return {}
    mount = tmp_path / "volumes" / "web"
    mount.mkdir(parents=True, mode=0o700)
    for key, content in secret_files(web[0]).items():
        (mount / key).write_bytes(content)
    token = str(mount / "token")
    return {
        "preload": [str(mount / "clusterkit_webauth.py")],
        "preload_argv": ["--token-file", token],
    }


def run_test_pod(
    pod: dict[str, Any],
    secrets: list[dict[str, Any]],
    tmp_path: Path,
    *,
    stranger: bool = False,
) -> str:
    """Play kubelet for the `helm test` pod: start a real scheduler and worker on loopback (with
    tls, from the scheduler's and the worker's Secrets, encryption required), mount the client
    Secret's files and run the pod's script; returns its output, failing on a non-zero exit.
    ``stranger``: the same pod with another CA's client files instead must fail."""
    from distributed import LocalCluster
    from distributed.security import Security

    c = container(pod)
    env = {e["name"]: e["value"] for e in c["env"]}
    protocol = env["DASK_PROTOCOL"]
    security = None
    if protocol == "tls":
        paths = {}
        for secret in secrets:
            directory = tmp_path / "volumes" / secret["metadata"]["name"]
            directory.mkdir(parents=True, mode=0o700)
            for key, content in secret_files(secret).items():
                (directory / key).write_bytes(content)
                (directory / key).chmod(0o400)
            paths[secret["metadata"]["name"]] = directory
        (client_volume,) = [v for v in pod_spec(pod)["volumes"] if "secret" in v]
        client = paths[client_volume["secret"]["secretName"]]
        env["TLS_DIR"] = str(client)
        scheduler, worker = paths["demo-scheduler-tls"], paths["demo-worker-tls"]
        security = Security(
            tls_ca_file=str(scheduler / "ca.crt"),
            tls_scheduler_cert=str(scheduler / "tls.crt"),
            tls_scheduler_key=str(scheduler / "tls.key"),
            tls_worker_cert=str(worker / "tls.crt"),
            tls_worker_key=str(worker / "tls.key"),
            tls_client_cert=str(client / "tls.crt"),
            tls_client_key=str(client / "tls.key"),
            require_encryption=True,
        )
    with LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        processes=False,
        host="127.0.0.1",
        protocol=protocol,
        security=security,
        dashboard_address=":0",
        scheduler_kwargs=web_gate(secrets, tmp_path),
    ) as cluster:
        assert cluster.scheduler_address.startswith(f"{protocol}://")
        env["SCHEDULER_ADDRESS"] = cluster.scheduler_address
        if "DASHBOARD_URL" in env:  # the Service's dashboard: this scheduler's
            env["DASHBOARD_URL"] = cluster.dashboard_link
        env["TEST_TIMEOUT"] = "30"
        if stranger and protocol == "tls":
            outsider = {
                **env,
                "TLS_DIR": str(stranger_files(tmp_path / "stranger")),
                "TEST_TIMEOUT": "5",
            }
            refused = subprocess.run(
                [sys.executable, *c["command"][1:]],
                env={**os.environ, **outsider},
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert refused.returncode != 0, "a pod without the client Secret ran a task"
            assert "FatalCommClosedError" in refused.stderr, refused.stderr[-2000:]  # TLS
        result = subprocess.run(
            [sys.executable, *c["command"][1:]],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("protocol", ["tls", "tcp"])
def test_helm_test_pod_connects_and_runs_a_task(protocol: str, tmp_path: Path) -> None:
    """The rendered `helm test` script against a real scheduler on loopback; with tls it uses the
    generated client Secret and the cluster the scheduler's and workers' certificates."""
    docs = render(tmp_path, {"protocol": protocol})
    (pod,) = by_kind(docs, "Pod")
    env = {e["name"]: e["value"] for e in container(pod)["env"]}
    assert env["SCHEDULER_ADDRESS"] == f"{protocol}://demo-scheduler.dask.svc.cluster.local:8786"
    output = run_test_pod(pod, by_kind(docs, "Secret"), tmp_path, stranger=True)
    assert "ok: 1 worker(s)" in output
    assert "ok: the dashboard Service refuses a request without the secret" in output


def test_every_dask_process_preloads_the_web_gate_from_its_secret(tmp_path: Path) -> None:
    """webAuth (the default): scheduler and workers preload the gate the web Secret carries
    (the package's own module, byte for byte), with the token's file by environment."""
    import clusterkit.webauth

    docs = render(tmp_path, {})
    web = named(docs, "Secret", "demo-web")
    files = secret_files(web)
    assert files["clusterkit_webauth.py"] == Path(clusterkit.webauth.__file__).read_bytes()
    assert len(files["token"]) == 43 and files["token"].isalnum()
    for doc in by_kind(docs, "Deployment"):
        c = container(doc)
        assert "/etc/clusterkit/web/clusterkit_webauth.py" in c["args"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["CLUSTERKIT_WEB_TOKEN_FILE"] == "/etc/clusterkit/web/token"
        volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
        assert volumes["web"]["secret"]["secretName"] == "demo-web"
    assert not [
        s
        for s in by_kind(render(tmp_path, {"webAuth": {"enabled": False}}), "Secret")
        if s["metadata"]["name"] == "demo-web"
    ]


def test_service_monitor_scrapes_metrics_with_the_web_secret(tmp_path: Path) -> None:
    docs = render(
        tmp_path, {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kp"}}}}
    )
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http-dashboard"
    assert endpoint["bearerTokenSecret"] == {"name": "demo-web", "key": "token"}
    assert monitor["metadata"]["labels"]["release"] == "kp"
    (service,) = by_kind(docs, "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()


def test_checkov_chart_has_no_failed_checks() -> None:
    tool("helm")  # checkov silently passes without helm on PATH
    report = checkov(CHART, "helm")
    summary = report["summary"]
    assert summary["passed"] > 50 and summary["resource_count"] >= 6, summary
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert failed == [], failed
    for skipped in report["results"]["skipped_checks"]:
        reason = skipped["check_result"].get("suppress_comment", "")
        assert reason and reason != "No comment provided", skipped["check_id"]
    print(f"checkov helm: {summary}")


# ---------------------------------------------------------------- helm against the API emulator


def _varint(buffer: bytes, index: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buffer[index]
        index += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, index


def _protobuf_fields(buffer: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of a protobuf message: ints for varints, bytes for the rest."""
    index = 0
    while index < len(buffer):
        key, index = _varint(buffer, index)
        number, wire_type = key >> 3, key & 7
        value: int | bytes
        if wire_type == 0:
            value, index = _varint(buffer, index)
        elif wire_type == 2:
            length, index = _varint(buffer, index)
            value, index = buffer[index : index + length], index + length
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, index = buffer[index : index + size], index + size
        else:
            raise ValueError(f"protobuf wire type {wire_type}")
        yield number, value


def _map_entry(entry: bytes) -> tuple[str, bytes]:
    fields = dict(_protobuf_fields(entry))
    return fields[1].decode(), fields.get(2, b"")


def secret_from_protobuf(body: bytes) -> dict[str, Any]:
    """The JSON form of a Secret that client-go sent as protobuf (helm's release storage): the
    k8s envelope (runtime.Unknown) around a v1.Secret, with the ObjectMeta fields helm sets."""
    if body[:4] != b"k8s\x00":
        raise ValueError("not a Kubernetes protobuf body")
    envelope = dict(_protobuf_fields(body[4:]))
    type_meta = dict(_protobuf_fields(envelope[1]))
    secret: dict[str, Any] = {
        "apiVersion": type_meta[1].decode(),
        "kind": type_meta[2].decode(),
        "metadata": {},
        "data": {},
    }
    if secret["kind"] != "Secret":
        raise ValueError(f"protobuf body of a {secret['kind']}")
    meta_names = {1: "name", 2: "generateName", 3: "namespace", 6: "resourceVersion"}
    for number, value in _protobuf_fields(envelope[2]):
        if number == 1:  # ObjectMeta
            for field, item in _protobuf_fields(value):
                if field in meta_names and item:  # proto2: unset strings come empty
                    secret["metadata"][meta_names[field]] = item.decode()
                elif field in (11, 12):  # labels, annotations
                    key, text = _map_entry(item)
                    group = "labels" if field == 11 else "annotations"
                    secret["metadata"].setdefault(group, {})[key] = text.decode()
        elif number == 2:  # data
            key, content = _map_entry(value)
            secret["data"][key] = base64.b64encode(content).decode()
        elif number == 3:
            secret["type"] = value.decode()
        elif number == 5:
            secret["immutable"] = bool(value)
    return secret


def chart_emulator() -> Any:
    """The tests/k8s API emulator with what the real `helm` client needs on top."""
    import aiohttp.web

    from tests.k8s.emulator import Emulator

    class HelmEmulator(Emulator):
        async def __call__(self, raw_request: Any) -> Any:
            # helm stores its releases as Secrets through a protobuf client, and marks them
            # deployed with a PUT, which kmock does not route: a merge patch of the same object
            protobuf = "protobuf" in raw_request.content_type
            if raw_request.method == "PUT":
                headers = {**raw_request.headers, "Content-Type": "application/merge-patch+json"}
                raw_request = raw_request.clone(method="PATCH", headers=headers)
            body = await raw_request.read()
            if protobuf:
                try:
                    body = json.dumps(secret_from_protobuf(body)).encode()
                except (ValueError, KeyError) as error:
                    message = f"protobuf body not understood: {error}"
                    return aiohttp.web.json_response(
                        {"kind": "Status", "code": 415, "message": message}, status=415
                    )
            raw_request._read_bytes = body
            return await super().__call__(raw_request)

        async def _serve_list(self, request: Any) -> Any:
            # typed clients (helm's release storage) decode a SecretList, not a List
            payload: dict[str, Any] = await super()._serve_list(request)
            for resource in self._get_resources():
                if resource == request.resource and self.resources[resource].kind:
                    payload["kind"] = f"{self.resources[resource].kind}List"
            return payload

        async def _serve_version(self, request: Any) -> Any:
            # kmock names the core group version "/v1"; client-go then maps no core kind
            payload = dict(await super()._serve_version(request))  # type: ignore[arg-type]
            payload["groupVersion"] = payload["groupVersion"].lstrip("/")
            return payload

    emulator = HelmEmulator()
    # the chart's kubeVersion; without a slash (helm asks /version, kr8s /version/)
    emulator["get /version"] << {"major": "1", "minor": "32", "gitVersion": "v1.32.0"}
    # `helm test` validates the hook pod with the OpenAPI document (no flag turns that off): an
    # empty one (protobuf: swagger "2.0") has no definitions, and unknown kinds go unvalidated
    emulator["get /openapi/v2"] << b"\x0a\x032.0"
    return emulator


@dataclasses.dataclass
class ApiServer:
    url: str
    kubeconfig: Path

    def get(self, path: str) -> dict[str, Any]:
        reply = httpx.get(f"{self.url}{path}", timeout=30)
        reply.raise_for_status()
        return dict(reply.json())

    def exists(self, path: str) -> bool:
        return httpx.get(f"{self.url}{path}", timeout=30).status_code == 200


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[ApiServer]:
    """The emulator served on loopback from a thread of this process."""
    import kmock

    started = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        async with chart_emulator() as emulator, kmock.Server(emulator) as server:
            state["port"] = server.port
            started.set()
            await state["stop"].wait()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:  # reported when the fixture ends
            state["error"] = error
        finally:
            started.set()

    thread = threading.Thread(target=run, name="api-emulator", daemon=True)
    thread.start()
    assert started.wait(60) and "port" in state, state.get("error")
    from tests.k8s.emulator import kubeconfig

    config = tmp_path / "kubeconfig"
    config.write_text(kubeconfig(state["port"]))
    config.chmod(0o600)
    try:
        yield ApiServer(f"http://127.0.0.1:{state['port']}", config)
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(30)
    assert "error" not in state, f"emulator errors: {state.get('error')!r}"


def test_helm_install_upgrade_keeps_certificates_and_helm_test_passes(
    api_server: ApiServer, tmp_path: Path
) -> None:
    """Real `helm install`, `helm upgrade` and `helm test` against the API emulator: the upgrade
    finds the generated Secrets with `lookup` and keeps them; the test pod (run here as the
    kubelet would) connects with the client Secret."""
    secrets = "/api/v1/namespaces/dask/secrets"
    kube = ["--kubeconfig", str(api_server.kubeconfig), "--namespace", "dask"]
    install = helm("install", "demo", str(CHART), *kube)
    assert "Secret dask/demo-client-tls" in install.stdout
    before = {name: api_server.get(f"{secrets}/{name}")["data"] for name in GENERATED_SECRETS}
    web_before = api_server.get(f"{secrets}/demo-web")["data"]["token"]

    values = write_values(tmp_path, {"worker": {"replicas": 3}})
    helm("upgrade", "demo", str(CHART), *kube, "-f", str(values))
    after = {name: api_server.get(f"{secrets}/{name}")["data"] for name in GENERATED_SECRETS}
    assert after == before, "helm upgrade replaced the generated certificates"
    worker = api_server.get("/apis/apps/v1/namespaces/dask/deployments/demo-worker")
    assert worker["spec"]["replicas"] == 3  # the upgrade did apply

    # a deleted component Secret is reissued by the same CA, the others stay
    reply = httpx.delete(f"{api_server.url}{secrets}/demo-client-tls", timeout=30)
    reply.raise_for_status()
    helm("upgrade", "demo", str(CHART), *kube, "-f", str(values))
    rotated = {name: api_server.get(f"{secrets}/{name}")["data"] for name in GENERATED_SECRETS}
    assert rotated["demo-client-tls"]["tls.crt"] != before["demo-client-tls"]["tls.crt"]
    assert rotated["demo-client-tls"]["ca.crt"] == before["demo-ca"]["tls.crt"]
    assert {n: rotated[n] for n in GENERATED_SECRETS[:3]} == {
        n: before[n] for n in GENERATED_SECRETS[:3]
    }

    test = subprocess.Popen(
        [tool("helm"), "test", "demo", *kube, "--timeout", "120s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=tool_env(),
    )
    try:
        pod_path = "/api/v1/namespaces/dask/pods/demo-test-connection"
        deadline = time.monotonic() + 60
        while not api_server.exists(pod_path):
            assert test.poll() is None, test.communicate()
            assert time.monotonic() < deadline, "helm test created no pod"
            time.sleep(0.2)
        pod = api_server.get(pod_path)
        mounted = [v["secret"]["secretName"] for v in pod_spec(pod)["volumes"] if "secret" in v]
        assert mounted == ["demo-client-tls"]
        stored = api_server.get(secrets)["items"]
        web = api_server.get(f"{secrets}/demo-web")
        assert web["data"]["token"] == web_before, "helm upgrade replaced the web secret"
        mounted_by_pods = [s for s in stored if s["type"] == "kubernetes.io/tls"] + [web]
        output = run_test_pod(pod, mounted_by_pods, tmp_path)
        assert "ok: 1 worker(s)" in output
        assert "ok: the dashboard Service refuses a request without the secret" in output
        reply = httpx.patch(
            f"{api_server.url}{pod_path}/status",
            json={"status": {"phase": "Succeeded"}},
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=30,
        )
        reply.raise_for_status()
        stdout, stderr = test.communicate(timeout=90)
    finally:
        if test.poll() is None:
            test.kill()
            test.wait()
    assert test.returncode == 0, stderr
    assert re.search(r"TEST SUITE:\s+demo-test-connection", stdout), stdout
    assert re.search(r"Phase:\s+Succeeded", stdout), stdout
