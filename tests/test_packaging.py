"""The package as a user gets it: wheel and sdist built, checked, installed outside the checkout.

An editable install hides missing package data, so the wheel is installed into a new virtual
environment (no system site packages: a missing dependency must fail here) and run from an
empty directory with an empty home: `--version`, `profiles list` and `get_client()` on the
embedded `local` profile. pip's cache makes the install a few seconds after the first run.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml"))


def run(*cmd: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command; on failure show its output (not just the exit code)."""
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def copy_source(dest: Path) -> Path:
    """The checkout as a clean clone would have it (tracked and unignored files, links kept)."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return dest


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Wheel and sdist built by `python -m build` from a copy of the checkout."""
    base = tmp_path_factory.mktemp("packaging")
    source = copy_source(base / "src")
    out = base / "dist"
    # no build isolation: tests reach no network; setuptools is in the project's venv
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "base": base}


def test_checkers_pass(dists: dict[str, Path]) -> None:
    """twine renders the metadata (README included); check-wheel-contents finds no stray files."""
    bin_dir = Path(sys.executable).parent
    run(bin_dir / "twine", "check", "--strict", dists["wheel"], dists["sdist"])
    run(bin_dir / "check-wheel-contents", dists["wheel"])


def test_wheel_carries_profiles_license_and_metadata(dists: dict[str, Path]) -> None:
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(wheel.read(metadata_name).decode())
        for stem in BUNDLED:
            packed = wheel.read(f"clusterkit/bundled_profiles/{stem}.yaml")
            assert packed == (ROOT / "profiles" / f"{stem}.yaml").read_bytes()
    assert "clusterkit/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert metadata["Requires-Python"] == ">=3.11"
    assert metadata["License-Expression"] == "Apache-2.0"
    assert {u.split(",")[0] for u in metadata.get_all("Project-URL")} >= {"Homepage", "Source"}
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert not any(n.startswith(("tests/", "bench/", "profiles/")) for n in names)


def test_sdist_has_real_files_only(dists: dict[str, Path]) -> None:
    with tarfile.open(dists["sdist"]) as sdist:
        members = sdist.getmembers()
    links = [m.name for m in members if m.issym() or m.islnk()]
    assert not links, f"the sdist carries links: {links}"
    names = {m.name.split("/", 1)[1] for m in members if "/" in m.name}
    assert {f"clusterkit/bundled_profiles/{s}.yaml" for s in BUNDLED} <= names
    assert {"LICENSE", "README.md", "pyproject.toml", "clusterkit/py.typed"} <= names


WHEELHOUSE = ROOT / ".tools" / "wheelhouse"


@pytest.fixture(scope="module")
def installed(dists: dict[str, Path]) -> tuple[Path, Path, dict[str, str]]:
    """The wheel alone (no extra) in a new venv (no system site packages); an empty cwd and
    home: (venv, cwd, environment)."""
    base = dists["base"]
    venv = base / "venv"
    run(sys.executable, "-m", "venv", venv)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    # the wheel's dependencies come from the wheelhouse scripts/setup/05-wheelhouse.sh fills:
    # a test reaches no package index
    assert WHEELHOUSE.is_dir(), f"{WHEELHOUSE} is missing: run scripts/setup/05-wheelhouse.sh"
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-index",
        "--find-links", WHEELHOUSE, dists["wheel"])
    empty, home = base / "empty", base / "home"
    empty.mkdir()
    home.mkdir()
    inherited = ("PYTHON", "CLUSTERKIT_", "VIRTUAL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    env.update(
        HOME=str(home),
        PATH=f"{venv / 'bin'}:/usr/bin:/bin",
        CLUSTERKIT_STATE_DIR=str(base / "state"),
        CLUSTERKIT_TEST_TOKEN=os.environ["CLUSTERKIT_TEST_TOKEN"],
    )
    return venv, empty, env


def test_installed_wheel_runs_from_an_empty_directory(
    installed: tuple[Path, Path, dict[str, str]],
) -> None:
    """The user's first minutes: --version, profiles list, get_client() on `local`."""
    venv, empty, env = installed
    version = run("clusterkit", "--version", cwd=empty, env=env)
    assert version.strip() == "clusterkit 0.1.0"
    rows = json.loads(run("clusterkit", "profiles", "list", "--json", cwd=empty, env=env))
    assert sorted(r["name"] for r in rows) == BUNDLED
    assert all(r["error"] is None for r in rows), rows
    site = venv / "lib"
    assert all(Path(r["source"]).resolve().is_relative_to(site.resolve()) for r in rows), rows
    script = (
        "import clusterkit, distributed\n"
        "client = clusterkit.get_client()\n"
        "assert isinstance(client, distributed.Client)\n"
        "print(client.submit(sum, [1, 2, 3]).result())\n"
        "print(clusterkit.__file__)\n"
        "client.close()\n"
    )
    total, module = run(venv / "bin" / "python", "-c", script, cwd=empty, env=env).split()[-2:]
    assert total == "6"
    assert Path(module).resolve().is_relative_to(site.resolve())


def test_the_dashboard_a_plain_install_prints_draws_and_needs_its_secret(
    installed: tuple[Path, Path, dict[str, str]],
) -> None:
    """`clusterkit up` from the wheel with no extra prints a link whose page is Dask's status
    page with its plots (bokeh comes with the base install), not "Dask needs bokeh"; without
    the link's secret the page is refused; /metrics answers the secret as a bearer token."""
    import http.cookiejar
    import urllib.error
    import urllib.request

    _venv, empty, env = installed
    up = run("clusterkit", "up", "local", "--name", "plain", cwd=empty, env=env)
    try:
        up_lines = subprocess.run(
            ["clusterkit", "status", "plain"], cwd=empty, env=env, capture_output=True, text=True
        )
        link = next(w for w in (up + up_lines.stdout).split() if "?token=" in w).rstrip(",")
        opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        with opener.open(link, timeout=30) as page:
            html = page.read().decode()
        assert "bokeh.min.js" in html and "needs bokeh" not in html, html[:500]
        bare, _, secret = link.partition("?token=")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bare, timeout=30)
        assert refused.value.code == 403
        metrics = bare.rsplit("/", 1)[0] + "/metrics"
        asked = urllib.request.Request(metrics, headers={"Authorization": f"Bearer {secret}"})
        with urllib.request.urlopen(asked, timeout=30) as answer:
            assert b"dask_scheduler_workers" in answer.read()
    finally:
        run("clusterkit", "down", "plain", cwd=empty, env=env)
