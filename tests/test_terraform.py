"""Terraform: fmt, offline init/validate/test of modules/profile, dask-cluster structure, checkov.

modules/dask-cluster and examples/gpu-cluster need the hashicorp/helm and kubernetes providers,
which cannot be fetched here: they get `fmt -check`, python-hcl2 structural checks and checkov.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ops import TERRAFORM, checkov, terraform_command, terraform_offline

pytestmark = pytest.mark.terraform

PROFILE = TERRAFORM / "modules" / "profile"
DASK_CLUSTER = TERRAFORM / "modules" / "dask-cluster"
EXAMPLE = TERRAFORM / "examples" / "gpu-cluster"


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for key, value in terraform_offline(tmp_path).items():
        monkeypatch.setenv(key, value)
    yield tmp_path


def profile_copy(directory: Path) -> Path:
    """A copy of modules/profile, so init writes nothing into the source tree."""
    target = directory / "profile"
    shutil.copytree(PROFILE, target)
    return target


def hcl(path: Path) -> dict[str, Any]:
    import hcl2
    from hcl2.utils import SerializationOptions

    merged: dict[str, Any] = {}
    options = SerializationOptions(strip_string_quotes=True, explicit_blocks=False)
    for file in sorted(path.glob("*.tf")):
        with file.open() as handle:
            for key, value in hcl2.load(handle, serialization_options=options).items():
                merged.setdefault(key, []).extend(value)
    return merged


def blocks(parsed: dict[str, Any], kind: str) -> dict[str, Any]:
    return {name: body for entry in parsed.get(kind, []) for name, body in entry.items()}


def test_fmt_check(offline: Path) -> None:
    result = terraform_command(TERRAFORM).fmt(check_input=True, recursive=True, list=True)
    assert result.retcode == 0, f"terraform fmt -check: unformatted files:\n{result.value}"


def test_fmt_check_catches_bad_formatting(offline: Path) -> None:
    """The fmt check is real: a misaligned copy fails it."""
    module = profile_copy(offline)
    outputs = module / "outputs.tf"
    outputs.write_text(outputs.read_text().replace("  value       =", "  value =", 1))
    result = terraform_command(module).fmt(check_input=True, recursive=True, list=True)
    assert result.retcode == 3


def test_profile_module_init_validate_test(offline: Path) -> None:
    module = profile_copy(offline)
    cli = terraform_command(module)
    init = cli.init(backend=False)
    assert init.retcode == 0, init.error
    validate = cli.validate()
    assert validate.value["valid"] is True, validate.value["diagnostics"]
    test = cli.test(json=False)
    assert test.retcode == 0, f"{test.value}\n{test.error}"
    assert "Success! 13 passed, 0 failed." in test.value, test.value


def test_profile_plan_outputs(offline: Path) -> None:
    """A plan with no providers gives the outputs: the rendered profile and Helm values."""
    import yaml

    module = profile_copy(offline)
    cli = terraform_command(module)
    assert cli.init(backend=False).retcode == 0
    plan = offline / "plan.out"
    result = cli.plan(
        vars={"name": "lab", "workers": 3, "gpus_per_worker": 1, "protocol": "ucx"},
        out=str(plan),
        json=False,
    )
    assert result.retcode == 0, result.error
    outputs = cli.show(str(plan)).value["planned_values"]["outputs"]
    assert (
        outputs["scheduler_address"]["value"] == "ucx://lab-scheduler.dask.svc.cluster.local:8786"
    )
    profile = yaml.safe_load(outputs["profile_yaml"]["value"])
    assert profile["workers"] == 3 and profile["protocol"] == "ucx"
    values = outputs["helm_values"]["value"]
    assert values["worker"]["gpus"] == 1 and values["fullnameOverride"] == "lab"


def test_profile_defaults_to_tls_with_the_charts_client_secret(offline: Path) -> None:
    """With no protocol and no Secret given, the chart generates the certificates and the
    profile's tls files come from its client Secret."""
    import yaml

    module = profile_copy(offline)
    cli = terraform_command(module)
    assert cli.init(backend=False).retcode == 0
    plan = offline / "plan.out"
    result = cli.plan(vars={"name": "lab", "namespace": "research"}, out=str(plan), json=False)
    assert result.retcode == 0, result.error
    outputs = {
        name: output["value"]
        for name, output in cli.show(str(plan)).value["planned_values"]["outputs"].items()
    }
    assert outputs["scheduler_address"] == "tls://lab-scheduler.research.svc.cluster.local:8786"
    values = outputs["helm_values"]
    assert values["protocol"] == "tls" and values["tls"]["secretName"] == ""
    assert outputs["client_tls_secret"] == "lab-client-tls"
    profile = yaml.safe_load(outputs["profile_yaml"])
    assert profile["protocol"] == "tls"
    tls_dir = "~/.config/clusterkit/tls/lab"
    assert profile["tls"] == {
        "ca_file": f"{tls_dir}/ca.crt",
        "cert_file": f"{tls_dir}/tls.crt",
        "key_file": f"{tls_dir}/tls.key",
    }
    fetch = outputs["client_tls_fetch"].splitlines()
    assert fetch[0] == f"(umask 077 && mkdir -p {tls_dir})"
    assert fetch[3] == (
        "(umask 077 && kubectl -n research get secret lab-client-tls"
        f" -o jsonpath='{{.data.tls\\.key}}' | base64 -d > {tls_dir}/tls.key)"
    )


def test_dask_cluster_module_structure() -> None:
    parsed = hcl(DASK_CLUSTER)
    resources = {name: body for entry in parsed["resource"] for name, body in entry.items()}
    assert set(resources) == {"kubernetes_namespace", "kubernetes_service_account", "helm_release"}
    account = resources["kubernetes_service_account"]["this"]
    assert account["automount_service_account_token"] is False
    release = resources["helm_release"]["this"]
    assert "../../../charts/clusterkit" in release["chart"]
    assert (DASK_CLUSTER / "../../../charts/clusterkit/Chart.yaml").resolve().is_file()
    assert "module.profile.helm_values_yaml" in str(release["values"])
    assert release["atomic"] is True and release["wait"] is True
    (module,) = (body for entry in parsed["module"] for name, body in entry.items())
    assert module["source"] == "../profile"
    outputs = blocks(parsed, "output")
    assert {"scheduler_address", "profile", "client_tls_secret", "client_tls_fetch"} <= set(outputs)
    assert "module.profile.client_tls_secret" in str(outputs["client_tls_secret"]["value"])
    assert "module.profile.profile_yaml" in str(outputs["profile"]["value"])
    providers = parsed["terraform"][0]["required_providers"][0]
    assert {"helm", "kubernetes"} <= set(providers)


def test_dask_cluster_variables_match_profile_module() -> None:
    """Every profile variable is a dask-cluster variable with the same type, default and rule,
    and is passed through to the profile module."""
    profile_vars = blocks(hcl(PROFILE), "variable")
    cluster = hcl(DASK_CLUSTER)
    cluster_vars = blocks(cluster, "variable")
    (module,) = (body for entry in cluster["module"] for name, body in entry.items())
    for name, spec in profile_vars.items():
        assert name in cluster_vars, name
        assert cluster_vars[name].get("type") == spec.get("type"), name
        assert cluster_vars[name].get("default") == spec.get("default"), name
        assert bool(cluster_vars[name].get("validation")) == bool(spec.get("validation")), name
        assert module[name] == f"${{var.{name}}}", name
    for name in ("workers", "gpus_per_worker", "protocol", "image", "name"):
        assert cluster_vars[name]["validation"], name
    assert cluster_vars["protocol"]["default"] == "tls"  # secure by default
    assert cluster_vars["tls_secret_name"]["default"] == ""  # the chart generates certificates


def test_example_uses_the_module() -> None:
    parsed = hcl(EXAMPLE)
    (module,) = (body for entry in parsed["module"] for name, body in entry.items())
    assert module["source"] == "../../modules/dask-cluster"
    assert module["gpus_per_worker"] > 0 and module["protocol"] == "tls"
    outputs = blocks(parsed, "output")
    assert "module.dask.profile" in str(outputs["profile"]["value"])
    assert "module.dask.client_tls_fetch" in str(outputs["client_tls_fetch"]["value"])
    assert "tls_secret_name" not in module  # the chart's generated certificates


def test_checkov_terraform(tmp_path: Path) -> None:
    """No failed check on terraform/. checkov has policies only for the service account (none for
    helm_release or kubernetes_namespace), so a canary with a known-bad resource also proves the
    scanner finds problems here."""
    report = checkov(TERRAFORM, "terraform")
    summary = report["summary"]
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert failed == [], failed
    assert summary["parsing_errors"] == 0, summary
    assert summary["passed"] >= 2, summary  # CKV_K8S_21 and CKV_K8S_41 on the service account
    for skipped in report["results"].get("skipped_checks", []):
        reason = skipped["check_result"].get("suppress_comment", "")
        assert reason and reason != "No comment provided", skipped["check_id"]
    print(f"checkov terraform: {summary}")

    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "main.tf").write_text(
        'resource "kubernetes_pod" "canary" {\n'
        '  metadata {\n    name = "canary"\n  }\n'
        '  spec {\n    container {\n      name  = "c"\n      image = "busybox"\n    }\n  }\n'
        "}\n"
    )
    canary_summary = checkov(canary, "terraform")["summary"]
    assert canary_summary["failed"] > 5 and canary_summary["resource_count"] == 1, canary_summary
