"""A site's Dask config under a profile: the profile wins, Dask config (files and DASK_*
variables) fills what it leaves unset, and `profiles render --explain` names every source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PROFILE = "backend: slurm\ncores: 8\nmemory: 32GiB\nprocesses: 2\nworker: {gpus: 1}\n"


def clusterkit(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    return subprocess.run(
        [sys.executable, "-m", "clusterkit", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**environ, **env},
        timeout=120,
    )


def directive(script: str, flag: str) -> str | None:
    for line in script.splitlines():
        if line.startswith(f"#SBATCH {flag} "):
            return line.split(maxsplit=2)[2]
    return None


def test_dask_variables_fill_what_the_profile_leaves_unset(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(PROFILE)
    site = {"DASK_JOBQUEUE__SLURM__QUEUE": "site-q", "DASK_JOBQUEUE__SLURM__WALLTIME": "06:00:00"}
    script = clusterkit(tmp_path, "profiles", "render", "p.yaml", **site).stdout
    assert directive(script, "-p") == "site-q"
    assert directive(script, "-t") == "06:00:00"  # no longer overridden by the profile default
    (tmp_path / "p.yaml").write_text(PROFILE + "walltime: '02:00:00'\n")
    script = clusterkit(tmp_path, "profiles", "render", "p.yaml", **site).stdout
    assert directive(script, "-t") == "02:00:00"  # the profile wins
    assert directive(script, "-p") == "site-q"


def test_dask_jobqueue_packaged_defaults_are_not_a_site_choice(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(PROFILE)
    script = clusterkit(tmp_path, "profiles", "render", "p.yaml").stdout
    assert directive(script, "-t") == "01:00:00"  # clusterkit's default, not dask-jobqueue's 00:30
    assert directive(script, "-p") is None


def test_explain_names_file_line_dask_config_key_default_and_derived(tmp_path: Path) -> None:
    config = tmp_path / "dask"
    config.mkdir()
    (config / "site.yaml").write_text(
        "jobqueue:\n  slurm:\n    account: proj42\n    job-extra-directives: ['--qos=high']\n"
        "    walltime: '08:00:00'\n"
    )
    (tmp_path / "p.yaml").write_text(PROFILE + "walltime: '02:00:00'\n")
    explain = ("profiles", "render", "p.yaml", "--explain")
    done = clusterkit(tmp_path, *explain, DASK_CONFIG=str(config))
    assert done.returncode == 0, done.stderr
    rows = {
        cells[0]: cells[1:]
        for line in done.stdout.splitlines()
        if len(cells := [c.strip() for c in line.strip("│┃ ").split("│")]) == 3
    }
    assert rows["account"] == ["proj42", "Dask config jobqueue.slurm.account"]
    key = "jobqueue.slurm.job-extra-directives"
    assert rows["job_extra"] == ['["--qos=high"]', f"Dask config {key}"]
    assert rows["walltime"] == ["02:00:00", "p.yaml:6"]
    assert rows["cores"] == ["8", "p.yaml:2"]
    assert rows["worker.threads"] == ["4", "derived"]
    assert rows["protocol"] == ["tls", "default"]


def test_a_bad_site_value_is_one_line_naming_the_config_key(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(PROFILE)
    done = clusterkit(
        tmp_path, "profiles", "render", "p.yaml", DASK_JOBQUEUE__SLURM__WALLTIME="4h"
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2
    assert "walltime" in done.stderr
    assert "(from Dask config jobqueue.slurm.walltime)" in done.stderr
