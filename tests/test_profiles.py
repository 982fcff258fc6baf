"""Profiles: loading, extends, interpolation, and the exact one-line message for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.errors import ProfileError
from clusterkit.profiles import discover, load_profile, resolved_data
from clusterkit.schema import MODELS, json_schema

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = sorted((ROOT / "profiles").glob("*.yaml"))


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def message(path: Path) -> str:
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    return info.value.one_line()


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.stem)
def test_bundled_profiles_validate(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = load_profile(path)
    assert profile.name == path.stem
    assert profile.backend_name in MODELS


def test_every_backend_has_a_bundled_example() -> None:
    backends = {load_profile(p).backend_name for p in BUNDLED}
    assert backends == set(MODELS)


def test_local_is_always_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert "local" in discover()
    assert load_profile().name == "local"


CASES = [
    ("tabs.yaml", "backend: local\n\tworkers: 2\n",
     "tabs.yaml:2: tab character in indentation (indent with spaces)"),
    ("syntax.yaml", "backend: local\nworkers: [1\n",
     "syntax.yaml:3: YAML syntax: expected ',' or ']', but got '<stream end>' "
     "(while parsing a flow sequence)"),
    ("dup.yaml", "backend: local\nworkers: 2\nworkers: 3\n",
     "dup.yaml:3: workers: duplicate key 'workers'"),
    ("empty.yaml", "# only a comment\n",
     "empty.yaml:1: empty profile (a profile is a mapping with at least `backend:`)"),
    ("list.yaml", "- a\n- b\n", "list.yaml:1: the top level must be a mapping, got a list"),
    ("nobackend.yaml", "workers: 2\n",
     "nobackend.yaml:1: backend: required field is missing (one of: local, local-cuda, ssh, "
     "slurm, pbs, sge, htcondor, kubernetes, address)"),
    ("unknownbackend.yaml", "backend: locl\n",
     "unknownbackend.yaml:1: backend: unknown backend 'locl' (did you mean 'local'?)"),
    ("unknownkey.yaml", "backend: local\nworker:\n  thraeds: 2\n",
     "unknownkey.yaml:3: worker.thraeds: unknown field (did you mean 'threads'?)"),
    ("type.yaml", "backend: local\nworkers: two\n",
     "type.yaml:2: workers: expected an integer, got 'two'"),
    ("zero.yaml", "backend: local\nworker:\n  threads: 0\n",
     "zero.yaml:3: worker.threads: must be at least 1, got 0"),
    ("negative.yaml", "backend: local\nworkers: -3\n",
     "negative.yaml:2: workers: must be at least 0, got -3"),
    ("absurd.yaml", "backend: local\nworkers: 5000\n",
     "absurd.yaml:2: workers: must be at most 1024, got 5000"),
    ("size.yaml", "backend: local\nworker:\n  memory: 24 Gx\n",
     "size.yaml:3: worker.memory: expected a size like '24GiB', got '24 Gx'"),
    ("duration.yaml", "backend: local\nstart_timeout: 5 parsecs\n",
     "duration.yaml:2: start_timeout: expected a duration like '90s' or '5m', got '5 parsecs'"),
    ("protocol.yaml", "backend: local\nprotocol: udp\n",
     "protocol.yaml:2: protocol: expected one of 'tcp', 'tls' or 'ucx', got 'udp'"),
    ("protocol2.yaml", "backend: local\nprotocol: tpc\n",
     "protocol2.yaml:2: protocol: expected one of 'tcp', 'tls' or 'ucx', got 'tpc' "
     "(did you mean 'tcp'?)"),
    ("adapt.yaml", "backend: local\nadapt: {minimum: 5, maximum: 2}\n",
     "adapt.yaml:2: adapt: minimum (5) is above maximum (2)"),
    ("pytag.yaml", "backend: local\nenv: !!python/object/apply:os.system ['touch /tmp/pwned']\n",
     "pytag.yaml:2: env: YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not "
     "allowed (profiles are plain data; remove the tag)"),
    ("customtag.yaml", "backend: local\nworkers: !evil 3\n",
     "customtag.yaml:2: workers: YAML tag '!evil' is not allowed (profiles are plain data; "
     "remove the tag)"),
    ("bomb.yaml",
     "a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
     "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
     "e: [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nbackend: local\n",
     "bomb.yaml:1: document expands to more than 10000 nodes (alias bomb?)"),
    ("binary.yaml", b"\x7fELF\x02\x01\x01\x00\x00garbage",
     "binary.yaml:1: binary data (NUL byte): not a YAML text file"),
    ("latin1.yaml", b"backend: local\ndescription: caf\xe9\n",
     "latin1.yaml:2: not UTF-8 text (byte 0xe9) (save the file as UTF-8)"),
    ("envunset.yaml", "backend: local\ndescription: ${CLUSTERKIT_SURELY_UNSET}\n",
     "envunset.yaml:2: description: environment variable CLUSTERKIT_SURELY_UNSET is not set "
     "(export CLUSTERKIT_SURELY_UNSET=... or write ${CLUSTERKIT_SURELY_UNSET:-default})"),
    ("cycle.yaml", "backend: local\nextends: cycle\n",
     "cycle.yaml:2: extends: `extends` forms a cycle: cycle -> cycle"),
    ("noparent.yaml", "backend: local\nextends: no-such-parent\n",
     "noparent.yaml:2: extends: no profile named 'no-such-parent' (see `clusterkit profiles "
     "list`)"),
    ("badname.yaml", "backend: local\nextends: ../etc/passwd\n",
     "badname.yaml:2: extends: profile name '../etc/passwd' is not a plain name (use letters, "
     "digits, '-', '_' and '.', without path separators)"),
    ("twodocs.yaml", "backend: local\n---\nbackend: local\n",
     "twodocs.yaml:3: a profile is one YAML document"),
    ("merge.yaml", "base: &b {workers: 2}\nbackend: local\n<<: *b\n",
     "merge.yaml:3: merge keys ('<<') are not supported (use `extends: other-profile` instead)"),
    ("walltime.yaml", "backend: slurm\nwalltime: 4h\n",
     "walltime.yaml:2: walltime: expected a walltime like '04:00:00' or '1-12:00:00', got '4h'"),
    ("gpus.yaml", "backend: local-cuda\nworker: {gpus: 2}\n",
     "gpus.yaml:1: local-cuda runs one worker per GPU: worker.gpus must be 1"),
    ("threads.yaml", "backend: slurm\ncores: 8\nprocesses: 2\nworker: {threads: 5}\n",
     "threads.yaml:1: worker.threads (5) is above the cores each worker has "
     "(cores/processes = 4)"),
]


@pytest.mark.parametrize(("name", "text", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_exact_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str, expected: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTERKIT_SURELY_UNSET", raising=False)
    path = write(tmp_path, name, text)
    assert message(Path(name)) == expected
    assert "\n" not in expected
    assert not Path("/tmp/pwned").exists()
    assert path.exists()


def test_cycle_over_two_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "a.yaml", "backend: local\nextends: b\n")
    write(tmp_path, "b.yaml", "extends: a\nworkers: 1\n")
    assert message(Path("a.yaml")) == "b.yaml:1: extends: `extends` forms a cycle: a -> b -> a"


@pytest.mark.parametrize("bad", ["../etc/passwd", "a/b", "x..y", ".hidden", ""])
def test_profile_names_must_be_plain(bad: str) -> None:
    with pytest.raises(ProfileError, match="is not a plain name"):
        load_profile(bad)


def test_unknown_profile_suggests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError) as info:
        load_profile("locl")
    assert info.value.one_line() == "no profile named 'locl' (did you mean 'local'?)"


def test_extends_merges_three_levels_and_keeps_lines(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CK_THREADS", "3")
    base = "backend: local\nworkers: 3\nworker:\n  threads: 2\n  memory: 1GiB\n"
    write(tmp_path, "base.yaml", base)
    write(tmp_path, "mid.yaml", "extends: base\nworker:\n  threads: ${CK_THREADS}\n")
    write(tmp_path, "top.yaml", "extends: mid\ndescription: ${CK_DESC:-fallback}\nworker:\n"
                                "  memory: 2GiB\n  flavour: 1\n")
    assert message(Path("top.yaml")) == (
        "top.yaml:5: worker.flavour: unknown field (known fields: gpus, memory, resources, threads)"
    )
    write(tmp_path, "top.yaml", "extends: mid\ndescription: ${CK_DESC:-fallback}\nworker:\n"
                                "  memory: 2GiB\n")
    profile = load_profile(Path("top.yaml"))
    assert (profile.workers, profile.worker.threads, profile.worker.memory) == (3, 3, 2 * 2**30)
    assert profile.description == "fallback"
    write(tmp_path, "top.yaml", "extends: mid\nworkers: 0\nadapt: {minimum: 0, maximum: 1}\n"
                                "worker:\n  threads: 300\n")
    assert message(Path("top.yaml")) == "top.yaml:5: worker.threads: must be at most 256, got 300"
    write(tmp_path, "mid.yaml", "extends: base\nworker:\n  memory: lots\n")
    write(tmp_path, "top.yaml", "extends: mid\n")
    assert message(Path("top.yaml")) == (
        "mid.yaml:3: worker.memory: expected a size like '24GiB', got 'lots'"
    )


def test_dollar_escape_and_resolved_view(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "p.yaml", "backend: local\ndescription: costs $$5\nenv: {A: '${HOME}'}\n")
    data = resolved_data(Path("p.yaml"))
    assert data["description"] == "costs $5"
    assert data["env"]["A"] == str(Path.home())


def test_json_schema_covers_every_backend() -> None:
    schema = json_schema()
    text = json.dumps(schema)
    for backend in MODELS:
        assert f'"{backend}"' in text


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterkit", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=60)


def test_cli_bad_profile_is_one_line_exit_2(tmp_path: Path) -> None:
    write(tmp_path, "x.yaml", "backend: local\nworkers: many\n")
    done = run_cli("profiles", "validate", "x.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == "error: x.yaml:2: workers: expected an integer, got 'many'\n"
    done = run_cli("up", "x.yaml", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2, "error: x.yaml:2: workers: expected an integer, got 'many'\n")
    assert "Traceback" not in done.stderr


def test_cli_validate_all_bundled_and_list_json() -> None:
    done = run_cli("profiles", "validate", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    listed = json.loads(run_cli("profiles", "list", "--json", cwd=ROOT).stdout)
    assert {row["name"] for row in listed} >= {p.stem for p in BUNDLED}
    assert all(row["error"] is None for row in listed)


def test_cli_show_and_render(tmp_path: Path) -> None:
    shown = run_cli("profiles", "show", "local", "--json", cwd=ROOT)
    assert json.loads(shown.stdout)["backend"] == "local"
    rendered = run_cli("profiles", "render", "local", cwd=ROOT)
    assert "LocalCluster" in rendered.stdout and '"host": "127.0.0.1"' in rendered.stdout
    bad = run_cli("profiles", "render", "local", "--format", "yaml", cwd=ROOT)
    assert (bad.returncode, bad.stderr) == (
        2, "error: unknown format 'yaml' (one of: native, helm-values, tfvars)\n")


def test_help_imports_no_heavy_library() -> None:
    code = ("import sys; from clusterkit.cli import app; "
            "heavy={'distributed','torch','optuna','dask_jobqueue','asyncssh','kopf',"
            "'dask_kubernetes','pydantic','dask'}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
    assert run_cli("--help").returncode == 0
    assert run_cli("--version").stdout.startswith("clusterkit ")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("backend: local-cuda\ncuda:\n  rmm_maximum_pool_sise: 4GB\n",
         "p.yaml:2: cuda: rmm_maximum_pool_sise: not an option of LocalCUDACluster in this "
         "dask-cuda (did you mean 'rmm_maximum_pool_size'?)"),
        ("backend: local-cuda\ncuda: {n_workers: 3}\n",
         "p.yaml:2: cuda: n_workers is set by clusterkit: use the profile's workers"),
        ("backend: local-cuda\ncuda: {rmm_pool_size: 1GB}\n",
         "p.yaml:2: cuda: rmm_pool_size is set by clusterkit: use the profile's rmm_pool_size"),
        ("backend: slurm\nworker: {gpus: 1}\ncuda: {log_spilling: true}\n",
         "p.yaml:3: cuda: log_spilling: not an option of `dask cuda worker` in this dask-cuda"),
        ("backend: slurm\nworker: {gpus: 1}\ncuda: {multiprocessing_method: thread}\n",
         "p.yaml:3: cuda: multiprocessing_method: 'thread' is not one of 'spawn', 'fork', "
         "'forkserver'."),
        ("backend: local\ncuda: {pre_import: [json]}\n",
         "p.yaml:1: cuda options need GPU workers (worker.gpus: 1)"),
        ("backend: local-cuda\ncuda: {rmm_release_threshold: 30GB}\n",
         "p.yaml:1: cuda.rmm_release_threshold needs rmm_async: true (dask-cuda's rule)"),
        ("backend: slurm\nworker: {gpus: 1}\ncuda: {rmm_release_threshold: 30GB}\n",
         "p.yaml:1: cuda.rmm_release_threshold needs rmm_async: true (dask-cuda's rule)"),
        ("backend: local-cuda\nrmm_maximum_pool_size: 4GB\n",
         "p.yaml:2: rmm_maximum_pool_size: unknown field (a dask-cuda option: write it under "
         "`cuda:` (rmm_maximum_pool_size: ...))"),
    ],
)
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_cuda_options_are_checked_against_the_installed_dask_cuda(
    tmp_path: Path, monkeypatch, text: str, expected: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(text)
    assert message(Path("p.yaml")) == expected
