"""The version ranges: declared once (pyproject.toml, read back from the installed metadata),
named by `clusterkit doctor` when Dask, distributed, Optuna or torch falls outside them, and
held by CI at both ends (constraints/ci.txt inside them; constraints/floor.txt at their floors)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from typer.testing import CliRunner

from clusterkit import doctor as doctor_module
from clusterkit.cli import app
from clusterkit.doctor import WATCHED, declared_ranges, version_warnings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def declared(tools: bool = True) -> list[Requirement]:
    """Every requirement pyproject.toml declares, the extras' included (``tools=False``: not
    the test tools, which are CI's own and not a user's dependencies)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for name, extra in project["optional-dependencies"].items():
        if tools or name != "test-tools":
            lines += [line for line in extra if not line.startswith("clusterkit[")]
    return [Requirement(line) for line in lines]


def pins(name: str) -> dict[str, str]:
    """A constraints file: package -> the version it holds."""
    found = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line):
            found[match[1].lower().replace("_", "-")] = match[2]
    return found


def test_the_doctor_reads_the_ranges_pyproject_declares() -> None:
    ranges = declared_ranges()
    assert set(ranges) == set(WATCHED)
    for requirement in declared():
        if requirement.name in ranges:
            assert SpecifierSet(ranges[requirement.name]) == requirement.specifier


def test_one_warning_line_per_package_outside_its_range() -> None:
    inside = {"dask": "2099.1.0", "distributed": "2099.1.0", "optuna": "99.0", "torch": "99.0"}
    assert version_warnings(inside) == []
    below = {**inside, "dask": "2024.1.0", "torch": "2.0.1+cpu"}
    lines = version_warnings(below)
    assert [line.split()[:2] for line in lines] == [["dask", "2024.1.0"], ["torch", "2.0.1+cpu"]]
    assert "outside the range clusterkit is tested with (dask>=" in lines[0]
    assert version_warnings({"dask": "2099.1.0"}) == []  # the others not installed: no line


def test_doctor_prints_the_warning_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor_module, "run_checks", lambda profile: [])
    monkeypatch.setattr(doctor_module, "version_warnings", lambda: ["dask 1.0 is outside"])
    result = CliRunner().invoke(app, ["doctor", "local"])
    assert result.exit_code == 0, result.output
    assert "warning: dask 1.0 is outside" in result.stderr


def test_every_dependency_is_an_open_range_or_says_why_not() -> None:
    """A `==` or a `<` in pyproject needs its reason on the same line (a known break, or the
    RAPIDS calendar releases that only work together)."""
    text = (ROOT / "pyproject.toml").read_text().split("[project.urls]")[0]
    for line in text.splitlines():
        if re.search(r'"[A-Za-z0-9_.\-\[\]]+(==|<|~=)', line):
            assert "#" in line, f"an exact or capped requirement without its reason: {line}"


def test_ci_and_floor_constraints_lie_inside_the_ranges() -> None:
    ci, floor = pins("ci.txt"), pins("floor.txt")
    for requirement in declared(tools=False):
        name = requirement.name.lower()
        for held, file in ((ci, "ci.txt"), (floor, "floor.txt")):
            if name in held:
                assert requirement.specifier.contains(held[name], prereleases=True), (name, file)
        spec = str(requirement.specifier)
        if spec.startswith(">=") and "," not in spec:  # an open range: CI tests its floor
            assert floor.get(name) == spec[2:] or floor.get(name, "").startswith(spec[2:] + ".")
