"""The Helm chart: lint, render, validate manifests, schema, NOTES profile, helm test, checkov."""

from __future__ import annotations

import functools
import importlib.resources
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops import CHART, K8S_VERSION, checkov, documents, helm, template, tool, write_values

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
TLS = {"protocol": "tls", "tls": {"secretName": "dask-tls"}}
OPERATOR = {"operator": {"enabled": True}}
CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu": GPU,
    "tls": TLS,
    "ucx": {"protocol": "ucx"},
    "operator": OPERATOR,
    "operator-gpu-tls": {**GPU, **TLS, **OPERATOR},
}


def render(tmp_path: Path, values: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    return documents(template(write_values(tmp_path, values), **kwargs).stdout)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]
    return spec["containers"][0]


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

    docs = render(tmp_path, CASES[case])
    kinds = sorted(d["kind"] for d in docs)
    operator = case.startswith("operator")
    expected = ["DaskCluster"] if operator else ["Deployment", "Deployment", "Service"]
    assert kinds == sorted([*expected, "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "Pod"])
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


def test_default_is_cpu_tcp_and_hardened(tmp_path: Path) -> None:
    docs = render(tmp_path, {})
    worker = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "demo-worker")
    c = container(worker)
    assert c["args"][:3] == ["dask", "worker", "tcp://demo-scheduler.dask.svc.cluster.local:8786"]
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
    assert by_kind(docs, "Pod")[0]["metadata"]["annotations"]["helm.sh/hook"] == "test"


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
        assert secrets == ["dask-tls"], doc["metadata"]["name"]
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
        ({"protocol": "tls"}, "secretName"),
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

    plain = profile_of(notes(tmp_path, GPU))
    model = AddressProfile.model_validate(plain)
    assert model.address == "tcp://demo-scheduler.dask.svc.cluster.local:8786"
    assert model.workers == 6  # 3 pods x 2 GPUs, one dask-cuda worker per GPU
    assert model.tls is None

    text = notes(tmp_path / "tls", TLS, namespace="research")
    model = AddressProfile.model_validate(profile_of(text))
    assert model.address == "tls://demo-scheduler.research.svc.cluster.local:8786"
    assert model.tls is not None and model.tls.key_file.endswith("/demo/tls.key")
    assert "get secret dask-tls" in text


def test_helm_test_pod_connects_and_runs_a_task(tmp_path: Path) -> None:
    """Run the rendered `helm test` script against a real scheduler on loopback."""
    from distributed import LocalCluster

    (pod,) = by_kind(render(tmp_path, {}), "Pod")
    c = container(pod)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SCHEDULER_ADDRESS"] == "tcp://demo-scheduler.dask.svc.cluster.local:8786"
    with LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        processes=False,
        host="127.0.0.1",
        protocol="tcp",
        dashboard_address=":0",
    ) as cluster:
        env["SCHEDULER_ADDRESS"] = cluster.scheduler_address
        env["TEST_TIMEOUT"] = "30"
        result = subprocess.run(
            [sys.executable, *c["command"][1:]],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok: 1 worker(s)" in result.stdout


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
