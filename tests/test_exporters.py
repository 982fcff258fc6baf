"""One spec for every door: a kubernetes profile exported as Helm values and as tfvars describes
the same cluster (Terraform's plan of modules/profile vs the exporter; the chart's NOTES profile
vs the module's profile output)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from clusterkit.errors import BadInput
from clusterkit.exporters import release_name, to_helm_values, to_tfvars
from clusterkit.schema import AddressProfile, KubernetesProfile
from tests.ops import TERRAFORM, documents, template, terraform_command, terraform_offline
from tests.test_chart import notes, profile_of
from tests.test_terraform import blocks, hcl

pytestmark = [pytest.mark.chart, pytest.mark.terraform]

SPEC: dict[str, Any] = {
    "backend": "kubernetes",
    "image": "ghcr.io/dask/dask:2026.7.1-py3.11",
    "namespace": "research",
    "workers": 4,
    "worker": {"threads": 2, "memory": "24GiB", "gpus": 2, "resources": {"FOO": 1}},
    "protocol": "tls",
    "service_type": "LoadBalancer",
    "resources": {"requests": {"cpu": "8", "memory": "48Gi"}, "limits": {"memory": "96Gi"}},
    "scheduler_resources": {"requests": {"cpu": "1"}},
    "node_selector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Equal", "value": "yes", "tolerationSeconds": 300},
    ],
    "env": {"NCCL_DEBUG": "WARN", "LITERAL": "${not_interpolated} %{nor_this}"},
    "preload": ["mylib.setup"],
}


def k8s_profile(spec: dict[str, Any] = SPEC, name: str = "k8s_GPU") -> KubernetesProfile:
    profile = KubernetesProfile.model_validate(spec)
    profile.named(name)
    return profile


@pytest.fixture
def planned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Plan terraform/modules/profile (a copy) with a tfvars file; return its outputs."""
    for key, value in terraform_offline(tmp_path).items():
        monkeypatch.setenv(key, value)

    def plan(tfvars: str) -> dict[str, Any]:
        module = tmp_path / "profile"
        shutil.copytree(TERRAFORM / "modules" / "profile", module, dirs_exist_ok=True)
        (tmp_path / "cluster.tfvars").write_text(tfvars)
        cli = terraform_command(module)
        assert cli.init(backend=False).retcode == 0
        out = tmp_path / "plan.out"
        result = cli.plan(var_files=[str(tmp_path / "cluster.tfvars")], out=str(out), json=False)
        assert result.retcode == 0, f"{result.error}\n{tfvars}"
        outputs = cli.show(str(out)).value["planned_values"]["outputs"]
        return {key: output["value"] for key, output in outputs.items()}

    return plan


def test_helm_values_and_tfvars_describe_the_same_cluster(planned: Any, tmp_path: Path) -> None:
    profile = k8s_profile()
    values = to_helm_values(profile)
    outputs = planned(to_tfvars(profile))
    assert outputs["helm_values"] == values
    assert outputs["name"] == release_name(profile) == "k8s-gpu"
    assert outputs["dask_workers"] == 8 and outputs["total_gpus"] == 8
    assert values["env"]["LITERAL"] == "${not_interpolated} %{nor_this}"

    # the chart renders with those values, and its NOTES print the module's profile
    values_file = tmp_path / "exported.yaml"
    values_file.write_text(yaml.safe_dump(values))
    docs = documents(template(values_file, release="anything", namespace="research").stdout)
    worker = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "k8s-gpu-worker"
    )
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:4] == [
        "dask",
        "cuda",
        "worker",
        outputs["scheduler_address"],
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert worker["spec"]["template"]["spec"]["tolerations"] == SPEC["tolerations"]
    from_chart = profile_of(notes(tmp_path / "notes", values, namespace="research"))
    assert from_chart == outputs["profile"] == yaml.safe_load(outputs["profile_yaml"])
    AddressProfile.model_validate(from_chart)


def test_cpu_profile_round_trip(planned: Any, tmp_path: Path) -> None:
    spec = {"backend": "kubernetes", "image": "registry.local:5000/dask:1.0", "workers": 0}
    profile = k8s_profile(spec, name="cpu")
    outputs = planned(to_tfvars(profile))
    values = to_helm_values(profile)
    assert outputs["helm_values"] == values
    assert values["image"] == {
        "repository": "registry.local:5000/dask",
        "tag": "1.0",
        "digest": "",
        "pullPolicy": "IfNotPresent",
    }
    assert values["worker"]["memoryLimit"] == "auto" and values["tls"]["secretName"] == ""
    assert outputs["scheduler_address"] == "tls://cpu-scheduler.default.svc.cluster.local:8786"
    assert values["protocol"] == "tls"  # the default: the release issues its certificates
    values_file = tmp_path / "v.yaml"
    values_file.write_text(yaml.safe_dump(values))
    template(values_file)  # passes the values schema


def test_tfvars_fit_the_dask_cluster_module() -> None:
    import hcl2
    from hcl2.utils import SerializationOptions

    options = SerializationOptions(strip_string_quotes=True, explicit_blocks=False)
    parsed = hcl2.loads(to_tfvars(k8s_profile()), serialization_options=options)
    parsed = {k: v for k, v in parsed.items() if not k.startswith("__")}
    variables = blocks(hcl(TERRAFORM / "modules" / "dask-cluster"), "variable")
    assert set(parsed) <= set(variables)
    assert parsed["workers"] == 4 and parsed["gpus_per_worker"] == 2


def test_worker_groups_are_refused() -> None:
    spec = {**SPEC, "worker_groups": [{"name": "cpu", "workers": 2}]}
    with pytest.raises(BadInput, match="worker_groups"):
        to_helm_values(k8s_profile(spec))
