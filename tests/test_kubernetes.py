"""Kubernetes backend against the real dask-kubernetes operator on a kmock API emulator.

The harness process (tests/k8s) runs the emulator on 127.0.0.1, the operator (kopf) and a
kubelet shim that turns the operator's Deployments into real scheduler / worker processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask_kubernetes.operator  # noqa: F401 - a missing extra must fail this tier, not skip
import httpx
import kmock  # noqa: F401
import pytest
import yaml

from clusterkit import api
from clusterkit.backends.kubernetes import backend
from clusterkit.backends.kubernetes.manifest import GATE_FILE, TLS_MOUNT, validate_manifest
from clusterkit.client import get_client
from clusterkit.errors import ClusterkitError, ClusterStartError, ProfileError
from clusterkit.profiles import load_profile
from clusterkit.security import SERVER_NAMES, ClusterSecurity

pytestmark = pytest.mark.kubernetes

K8S = backend.KubernetesBackend()

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Harness:
    directory: Path
    port: int

    def faults(self, **faults: Any) -> None:
        url = f"http://127.0.0.1:{self.port}/__faults"
        httpx.post(url, json=faults, timeout=60).raise_for_status()

    def objects(self, plural: str, group: str = "kubernetes.dask.org/v1") -> list[dict[str, Any]]:
        base = "api/v1" if group == "v1" else f"apis/{group}"
        url = f"http://127.0.0.1:{self.port}/{base}/namespaces/default/{plural}"
        reply = httpx.get(url, timeout=60)
        return list(reply.json()["items"])

    def log_tail(self) -> str:
        path = self.directory / "harness.log"
        return path.read_text()[-3000:] if path.exists() else ""


def forget_cached_kubernetes_apis() -> None:
    """kr8s keeps one API object per thread and event loop, with the configuration it first
    loaded: a later module's harness on another port would be unreachable through it."""
    import kr8s.asyncio

    kr8s.asyncio.Api._instances.clear()  # shared by the sync Api


@pytest.fixture(scope="module")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """The emulator, the operator and the kubelet shim, with KUBECONFIG pointing at them; a
    fresh one per module (shared with the chaos tier's cases, worker pods of a 20 s start
    timeout were not created in time in the full CI run)."""
    directory = tmp_path_factory.mktemp("k8s")
    log = open(directory / "harness.out", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.k8s.harness", str(directory)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    old = os.environ.get("KUBECONFIG")
    try:
        deadline = time.monotonic() + 90
        while not (directory / "ready").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                output = (directory / "harness.out").read_text()[-3000:]
                pytest.fail(f"emulator harness did not start:\n{output}")
            time.sleep(0.1)
        os.environ["KUBECONFIG"] = str(directory / "kubeconfig")
        forget_cached_kubernetes_apis()
        harness = Harness(directory, int((directory / "ready").read_text()))
        yield harness
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        forget_cached_kubernetes_apis()
        process.send_signal(signal.SIGUSR1)  # the harness's quick stop (SIGTERM waits 5 s)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@pytest.fixture
def clean(k8s: Harness) -> Iterator[Harness]:
    """Faults off before and after; no DaskCluster or pod left behind by the test."""
    k8s.faults()
    yield k8s
    k8s.faults()
    assert k8s.objects("daskclusters") == []
    deadline = time.monotonic() + 30
    while k8s.objects("pods", "v1") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert k8s.objects("pods", "v1") == [], "pods left behind"


def write_profile(directory: Path, name: str, **fields: Any) -> Path:
    data = {
        "backend": "kubernetes",
        "service_type": "LoadBalancer",
        "workers": 2,
        "start_timeout": "150s",
        **fields,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------------------- render


def test_render_gpu_profile_is_valid_and_explicit() -> None:
    text = backend.render(load_profile("k8s-gpu"), ClusterSecurity())
    assert "&id" not in text and "null" not in text
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["DaskCluster", "DaskWorkerGroup"]
    worker = docs[0]["spec"]["worker"]["spec"]
    container = worker["containers"][0]
    assert container["args"][:3] == ["dask", "cuda", "worker"]
    assert container["args"][container["args"].index("--resources") + 1] == "GPU=1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
    assert worker["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert worker["tolerations"][0]["key"] == "nvidia.com/gpu"
    cpu = docs[1]["spec"]["worker"]["spec"]
    assert cpu["containers"][0]["args"][:2] == ["dask", "worker"] and "nodeSelector" not in cpu
    assert docs[0]["spec"]["idleTimeout"] == 3600
    for doc in docs:
        validate_manifest(doc)


def test_render_tls_and_adapt(tmp_path: Path) -> None:
    from clusterkit.security import generate_tls

    profile = load_profile(
        write_profile(tmp_path, "tlsad", protocol="tls", adapt={"minimum": 1, "maximum": 4})
    )
    text = backend.render(profile, generate_tls(tmp_path / "certs"))
    docs = {d["kind"]: d for d in yaml.safe_load_all(text)}
    assert set(docs) == {"Secret", "DaskCluster", "DaskAutoscaler"}
    # the scheduler's and workers' files; the client's key never leaves this machine
    assert set(docs["Secret"]["data"]) == {*SERVER_NAMES, GATE_FILE}  # + the web pages' gate
    scheduler = docs["DaskCluster"]["spec"]["scheduler"]["spec"]["containers"][0]
    assert "--tls-ca-file" in scheduler["args"] and scheduler["volumeMounts"][0]["name"] == "tls"
    assert f"{TLS_MOUNT}/scheduler-key.pem" in scheduler["args"]
    # the operator's scale-down and autoscaler reach the scheduler over its HTTP API
    routes = {e["name"]: e["value"] for e in scheduler["env"]}[
        "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"
    ]
    assert "distributed.http.scheduler.api" in json.loads(routes)
    assert docs["DaskAutoscaler"]["spec"] == {"cluster": "tlsad", "minimum": 1, "maximum": 4}


def test_validate_manifest_rejects_what_the_operator_chokes_on() -> None:
    docs = list(yaml.safe_load_all(backend.render(load_profile("k8s-gpu"), ClusterSecurity())))
    container = docs[0]["spec"]["worker"]["spec"]["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = 1
    with pytest.raises(ProfileError, match="is not of type 'string'"):
        validate_manifest(docs[0])
    container["resources"]["limits"]["nvidia.com/gpu"] = "1"
    container["env"] = None
    with pytest.raises(ProfileError, match="None is not of type 'array'"):
        validate_manifest(docs[0])
    container["env"] = []
    docs[0]["spec"]["worker"]["spec"]["tolerations"][0]["bogus"] = 1
    with pytest.raises(ProfileError, match="bogus"):
        validate_manifest(docs[0])


# ---------------------------------------------------------------------------- lifecycle


@pytest.mark.timeout(900)
def test_contract_up_get_client_runners_scale_down(clean: Harness, tmp_path: Path) -> None:
    from tests.contract import run_contract

    name = f"k8s-{uuid.uuid4().hex[:6]}"
    record = run_contract(write_profile(tmp_path, name), scale_to=3)
    assert record.extra["name"] == name and record.extra["namespace"] == "default"
    assert record.address.startswith("tls://127.0.0.1:")  # mutual TLS by default


def test_status_rows_say_connected(clean: Harness, tmp_path: Path) -> None:
    # `up --name` names the DaskCluster after the cluster, not the profile
    record = api.up(write_profile(tmp_path, "k8s-rows", workers=1), name="k8s-named")
    try:
        assert record.extra["name"] == "k8s-named"
        rows = K8S.describe_record(record)
        assert sorted((r.kind, r.state) for r in rows) == [
            ("pod/scheduler", "connected"),
            ("pod/worker", "connected"),
        ]
        # `clusterkit status` of a detached cluster gets the same rows from the backend
        assert sorted(r["state"] for r in api.status(record.name)["rows"]) == ["connected"] * 2
        # `clusterkit ls --kubernetes` sees the DaskCluster in the API
        assert "k8s-named" in {r["name"] for r in api.list_resources("kubernetes")}
        # the pods' gate, preloaded from the cluster's Secret: no page without the secret
        assert_web_pages_need_the_secret(record)
    finally:
        api.down(record.name)


def assert_web_pages_need_the_secret(record: Any) -> None:
    import urllib.error
    import urllib.request

    from clusterkit.webauth import read_token

    base = record.dashboard.rsplit("/", 1)[0]
    for page in ("/status", "/json/identity.json", "/metrics"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + page, timeout=10)
        assert refused.value.code == 403, page
    token = read_token(record.security["web_token_file"])
    asked = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(asked, timeout=10) as answer:
        assert b"dask_scheduler_workers" in answer.read()


@pytest.mark.parametrize("path_kind", ["up", "embedded"])
def test_pending_gpu_pods_fail_with_the_scheduler_reason(
    clean: Harness, tmp_path: Path, path_kind: str
) -> None:
    path = write_profile(tmp_path, "k8s-nogpu", workers=1, worker={"gpus": 1}, start_timeout="20s")
    start = api.up if path_kind == "up" else get_client
    # the backend's evidence reaches the message on every start path
    with pytest.raises(ClusterStartError, match=r"Insufficient nvidia\.com/gpu") as info:
        start(path)
    assert info.value.component == "workers"
    assert any("pending" in line for line in info.value.evidence)
    assert clean.objects("daskclusters", "kubernetes.dask.org/v1") == []


@pytest.mark.timeout(300)
def test_embedded_cluster_is_deleted_when_its_client_closes(clean: Harness, tmp_path: Path) -> None:
    from tests.contract import run_embedded_contract

    path = write_profile(tmp_path, "k8s-embedded", workers=1)
    run_embedded_contract(path, workloads=())
    assert clean.objects("daskclusters", "kubernetes.dask.org/v1") == []


# ---------------------------------------------------------------------------- failures


def test_missing_crd_is_one_line_with_the_install_command(clean: Harness, tmp_path: Path) -> None:
    clean.faults(no_crds=True)
    path = write_profile(tmp_path, "k8s-nocrd")
    with pytest.raises(ClusterkitError, match="CRD missing") as info:
        api.up(path)
    assert "helm install --repo https://helm.dask.org" in info.value.one_line()
    assert "\n" not in info.value.one_line()
    checks = {c.name: c for c in K8S.doctor(load_profile(path), ClusterSecurity())}
    assert not checks["DaskCluster CRD installed"].ok
    assert "helm install" in checks["DaskCluster CRD installed"].fix


def test_rbac_forbidden_is_one_line_and_doctor_names_it(clean: Harness, tmp_path: Path) -> None:
    clean.faults(forbidden=["daskclusters"])
    path = write_profile(tmp_path, "k8s-rbac")
    with pytest.raises(ClusterkitError, match="RBAC") as info:
        api.up(path)
    assert "forbidden" in info.value.one_line() and "\n" not in info.value.one_line()
    checks = {c.name: c for c in K8S.doctor(load_profile(path), ClusterSecurity())}
    assert not checks["RBAC: create daskclusters"].ok
    assert checks["RBAC: list pods"].ok


def test_doctor_all_green_but_gpu_nodes(clean: Harness) -> None:
    checks = {c.name: c for c in K8S.doctor(load_profile("k8s-gpu"), ClusterSecurity())}
    failed = sorted(name for name, check in checks.items() if not check.ok)
    assert failed == ["GPU nodes allocatable"], checks
    assert "0 nvidia.com/gpu" in checks["GPU nodes allocatable"].detail


@pytest.mark.timeout(600)
def test_tls_cluster_refuses_clients_without_its_certificates(
    clean: Harness, tmp_path: Path
) -> None:
    from distributed import Client

    from clusterkit.client import get_client

    record = api.up(write_profile(tmp_path, "k8s-tls", workers=1, protocol="tls"))
    try:
        assert record.address.startswith("tls://127.0.0.1:")
        assert [s["metadata"]["name"] for s in clean.objects("secrets", "v1")] == ["k8s-tls-tls"]
        with get_client(record.name) as client:
            assert client.submit(sum, [1, 2]).result(timeout=60) == 3
        with pytest.raises((OSError, TypeError)):
            Client(record.address.replace("tls://", "tcp://"), timeout=3)
    finally:
        api.down(record.name)
    assert clean.objects("secrets", "v1") == []


@pytest.mark.timeout(600)
def test_adapt_runs_through_the_operator_autoscaler(clean: Harness, tmp_path: Path) -> None:
    from clusterkit.client import get_client

    record = api.up(
        write_profile(tmp_path, "k8s-adapt", workers=1, adapt={"minimum": 1, "maximum": 2})
    )
    try:
        [scaler] = clean.objects("daskautoscalers")
        assert scaler["spec"] == {"cluster": "k8s-adapt", "minimum": 1, "maximum": 2}
        with get_client(record.name) as client:
            futures = client.map(time.sleep, [1.0] * 40, pure=False)
            client.wait_for_workers(2, timeout=120)
            client.gather(futures)
    finally:
        api.down(record.name)


@pytest.mark.timeout(600)
def test_project_directory_is_synced_to_pods(clean: Harness, tmp_path: Path) -> None:
    """Pods have no shared disk (forced copy here: the emulator's pods run on this host): the
    example project trains from the synced copy and resumes from checkpoint_dir; an objective
    imports its sibling module; an unchanged rerun sends nothing."""
    from tests.test_workdir import example_project_on

    client = get_client(write_profile(tmp_path, "k8s-workdir", workers=2))
    try:
        assert example_project_on(client, tmp_path, copy=True) == {"synced"}
    finally:
        client.close()


EMBEDDED_DRIVER = """
import sys, time
from clusterkit import get_client
get_client(sys.argv[1], timeout=60)
time.sleep(600)
"""


@pytest.mark.parametrize("path_kind", ["up", "embedded"])
@pytest.mark.timeout(300)
def test_process_killed_mid_start_leaves_a_dead_record_that_down_removes(
    clean: Harness, tmp_path: Path, path_kind: str
) -> None:
    """SIGKILL of `up` (or of a notebook's embedded get_client) once its DaskCluster exists:
    the claim written before creation makes it a dead cluster in `ls`, and `down` deletes it."""
    import json

    path = write_profile(tmp_path, "k8s-killed", workers=1)
    cli = [sys.executable, "-m", "clusterkit"]
    if path_kind == "up":
        command, name = [*cli, "up", str(path), "--name", "k8s-killed"], "k8s-killed"
    else:
        command, name = [sys.executable, "-c", EMBEDDED_DRIVER, str(path)], None
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not clean.objects("daskclusters") and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            time.sleep(0.05)
        [created] = clean.objects("daskclusters")
        name = name or created["metadata"]["name"]
    finally:
        process.kill()
        process.wait()
        if process.stderr:
            process.stderr.close()
    listed = subprocess.run(
        [*cli, "ls", "--orphans", "--json"], capture_output=True, text=True, timeout=60
    )
    rows = {row["name"]: row["state"] for row in json.loads(listed.stdout)}
    assert rows.get(name, "").startswith("dead"), rows
    down = subprocess.run([*cli, "down", name], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert clean.objects("daskclusters") == []
    assert (
        json.loads(
            subprocess.run(
                [*cli, "ls", "--json"], capture_output=True, text=True, timeout=60
            ).stdout
        )
        == []
    )


@pytest.mark.timeout(600)
def test_detached_search_attaches_to_the_cluster_from_up(clean: Harness, tmp_path: Path) -> None:
    """`hpo --detach -p NAME` on a Kubernetes cluster from `up`: its driver attaches to the
    DaskCluster by name, `runs wait` exits 0, the study holds each trial once, the cluster
    stays up until `down`."""
    from tests.contract import run_detached_contract

    name = "k8s-runs"
    profile = write_profile(tmp_path, name, workers=2)

    def still_up() -> None:
        assert [c["metadata"]["name"] for c in clean.objects("daskclusters")] == [name]

    run_detached_contract(tmp_path, profile, name, "pods", still_up, timeouts=(200, 240))
