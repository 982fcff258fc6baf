"""Test tiers, the CLUSTERKIT_REQUIRE switch, and the per-test leftover-process check.

Tiers are pytest markers (see pyproject). ``CLUSTERKIT_REQUIRE=local,ssh`` turns a skip in
those tiers into a failure, and a required tier that collected no test fails the session, so
CI can never pass by skipping.

Every process a test starts inherits ``CLUSTERKIT_TEST_TOKEN``; after each test, any process
carrying the token that did not exist before the test must be gone (polled for a few seconds,
since distributed's processes linger briefly after close). Session-scoped daemons (sshd,
slurmctld, the Kubernetes emulator) start before the baseline is taken and are not counted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

TIERS = (
    "unit",
    "local",
    "ssh",
    "slurm",
    "multinode",
    "pbs",
    "sge",
    "htcondor",
    "kubernetes",
    "chart",
    "terraform",
    "chaos",
    "docs",
    "gpu",
)
TOKEN_VAR = "CLUSTERKIT_TEST_TOKEN"
_TOKEN = os.environ.setdefault(TOKEN_VAR, uuid.uuid4().hex)
if _WORKER := os.environ.get("PYTEST_XDIST_WORKER"):  # a token per parallel worker, not shared
    _TOKEN = os.environ[TOKEN_VAR] = f"{_TOKEN.split('-')[0]}-{_WORKER}"


def required_tiers() -> set[str]:
    raw = os.environ.get("CLUSTERKIT_REQUIRE", "")
    tiers = {t.strip() for t in raw.split(",") if t.strip()}
    unknown = tiers - set(TIERS)
    if unknown:
        raise pytest.UsageError(f"CLUSTERKIT_REQUIRE names unknown tiers: {sorted(unknown)}")
    return tiers


def _tiers_of(item: pytest.Item) -> set[str]:
    """The test's tiers; a `gpu` test belongs to the gpu tier alone, whatever its module says."""
    tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
    return {"gpu"} if "gpu" in tiers else tiers


_seen_tiers: set[str] = set()

#: Fixtures that stand for one thing on this machine (a daemon and its munged, a Grid Engine
#: cell, a system user): under ``pytest -n`` every test using one runs in the same worker, in
#: order. Other tests run with the rest of their module, so module-scoped clusters start once.
ONE_PER_MACHINE = {
    "slurm": "slurm",
    "nodes": "slurm",  # the multi-node SLURM shares munged with the single-node one
    "sge": "sge",
    "k8s": "kubernetes",
    "clean": "kubernetes",
    "second_user": "second-user",
}


@pytest.hookimpl(tryfirst=True)  # before xdist appends the group to the test's id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouping = bool(os.environ.get("PYTEST_XDIST_WORKER")) and config.getvalue("loadgroup")
    for item in items:
        _seen_tiers.update(_tiers_of(item))
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_parallel_group(item)))
        if grouping:
            _name_the_group(item)


def _name_the_group(item: pytest.Item) -> None:
    """The group into the test's id, which xdist's scheduler reads: xdist 3.8 writes it to
    ``_nodeid``, which pytest 9 no longer reads (the id is ``_id``), so every test was its own
    unit and the shared daemons' tests ran in both workers at once."""
    from _pytest.nodeid import coerce_node_id

    groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
    if "@" not in item.nodeid:
        item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")  # type: ignore[attr-defined]


def _parallel_group(item: pytest.Item) -> str:
    if item.get_closest_marker("gpu"):  # one GPU machine's GPUs: one test at a time
        return "gpu"
    fixtures = getattr(item, "fixturenames", ())
    shared = sorted({ONE_PER_MACHINE[name] for name in fixtures if name in ONE_PER_MACHINE})
    return "+".join(shared) if shared else item.path.name


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """Under ``pytest -n``: the tiers each worker collected (the controller collects none)."""
    _seen_tiers.update(getattr(node, "workeroutput", {}).get("tiers", ()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped:
        return
    required = _tiers_of(item) & required_tiers()
    if required and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"required tier {sorted(required)} skipped: {reason}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workeroutput"):  # a worker reports to the controller
        session.config.workeroutput["tiers"] = sorted(_seen_tiers)
        return
    if session.config.option.collectonly or session.config.getoption("-k", None):
        return
    if session.config.getoption("-m", None):
        return
    missing = required_tiers() - _seen_tiers
    if missing:
        session.config.get_terminal_writer().line(
            f"required tiers collected no test: {sorted(missing)}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------------ leftover processes


#: Per-interpreter helpers that multiprocessing starts once and keeps for the life of the
#: pytest process itself (not something a test leaked).
_INTERPRETER_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def token_processes(token: str = _TOKEN) -> set[int]:
    """PIDs (other than this one and its multiprocessing helpers) carrying the test token."""
    needle = f"{TOKEN_VAR}={token}".encode()
    me = os.getpid()
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if fields[0] == b"Z" or needle not in environ.split(b"\0"):
            continue
        if int(fields[1]) == me and any(h in cmdline for h in _INTERPRETER_HELPERS):
            continue
        found.add(int(entry))
    return found


def describe(pids: set[int]) -> str:
    lines = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmd = handle.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            cmd = "?"
        lines.append(f"{pid}: {cmd}")
    return "\n".join(lines)


def wait_gone(baseline: set[int], seconds: float = 15.0) -> set[int]:
    """What is left of the processes not in ``baseline`` after up to ``seconds``. A scan of
    /proc takes about a millisecond, so the poll is fine-grained: most tests end with a few
    closing processes, and a coarse poll would add its interval to every one of them."""
    deadline = time.monotonic() + seconds
    while True:
        left = token_processes() - baseline
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a process of its own running (and kill what it left)."""
    baseline = token_processes()
    yield
    if request.node.get_closest_marker("allow_leftovers"):
        return
    fail_on_leftovers(baseline, "test")


def fail_on_leftovers(baseline: set[int], what: str) -> None:
    """Kill the token's processes not in ``baseline`` that outlive a short wait, and fail
    naming them (``what``: the test, the shared cluster)."""
    left = wait_gone(baseline)
    if left:
        text = describe(left)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        # the next test starts once they are dead: a spare rank process still dying could
        # otherwise be taken by its first trial
        wait_gone(baseline, seconds=10.0)
        pytest.fail(f"{what} left processes running:\n{text}", pytrace=False)


@pytest.fixture(autouse=True)
def isolated_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Each test gets its own clusterkit state directory and no inherited cluster settings."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(state))
    for var in ("CLUSTERKIT_SCHEDULER", "CLUSTERKIT_SECURITY", "CLUSTERKIT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    return state


# ------------------------------------------------------------------ GPU detection


def gpu_skip_reason() -> str | None:
    """None when an NVIDIA GPU is usable, else why not (for the gpu tier's skip)."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install 'clusterkit[cuda]')"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as error:
        return f"no GPU: NVML says {error}"
    return None if count else "no GPU: NVML sees 0 devices"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One SLURM for the session, shared by every module that uses it; a missing install fails
    (the tier is required), never skips."""
    from tests import slurm as harness

    absent = harness.missing()
    if absent:
        pytest.fail(f"SLURM is not installed (missing {absent}): run scripts/setup/20-slurm.sh")
    cluster = harness.start(tmp_path_factory.mktemp("slurm"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(cluster.conf))  # sbatch/squeue here and in supervisors
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="session")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The multinode tier's SLURM (tests/multinode.py), one for the session, shared by its
    modules; missing SLURM or namespaces fail (the tier is required), never skip."""
    from tests import multinode as harness

    reason = harness.missing_reason()
    if reason:
        pytest.fail(reason)
    cluster = harness.start(tmp_path_factory.mktemp("multinode"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def sge() -> Iterator[Any]:
    """One Grid Engine cell for the session (tests/sge.py); a missing install fails (the tier
    is required), never skips."""
    from tests import sge as harness

    absent = harness.missing()
    if absent:
        pytest.fail(
            f"Grid Engine is not installed (missing {absent}): run scripts/setup/25-gridengine.sh"
        )
    cell = harness.start()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in cell.env().items():  # qsub/qstat here and in supervisors
            patch.setenv(key, value)
        try:
            yield cell
        finally:
            cell.stop()
