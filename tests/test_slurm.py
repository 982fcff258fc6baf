"""The slurm backend against a real single-node SLURM (slurmctld + slurmd on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterkit import api
from clusterkit.backends.jobqueue.jobs import lifetime_plan
from clusterkit.backends.jobqueue.slurm import SLURMBackend
from clusterkit.client import get_client
from clusterkit.errors import ClusterStartError
from clusterkit.schema import SLURMProfile
from clusterkit.security import ClusterSecurity
from tests import slurm as S
from tests.contract import run_contract

SLURM = SLURMBackend()

pytestmark = pytest.mark.slurm

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("CLUSTERKIT_UPDATE_GOLDEN") == "1"


@pytest.fixture(autouse=True)
def empty_queue_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used SLURM must leave its queue empty."""
    yield
    if "slurm" not in request.fixturenames:
        return
    cluster: S.Slurm = request.getfixturevalue("slurm")
    left = cluster.queue()
    if left:
        cluster.empty_queue()
        pytest.fail(f"jobs left in the SLURM queue: {left}", pytrace=False)


def profile_data(tmp_path: Path, **fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "backend": "slurm",
        "queue": S.PARTITION,
        "workers": 1,
        "cores": 1,
        "memory": "1GiB",
        "walltime": "00:10:00",
        "log_directory": str(tmp_path / "joblogs"),
        "start_timeout": 90,
        "scheduler": {"dashboard": False},
    }
    data.update(fields)
    return data


def profile_file(tmp_path: Path, name: str = "sl", **fields: Any) -> Path:
    import yaml

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(profile_data(tmp_path, **fields)))
    return path


def model(tmp_path: Path, name: str = "sl", **fields: Any) -> SLURMProfile:
    profile = SLURMProfile.model_validate(profile_data(tmp_path, **fields))
    return profile.named(name)  # type: ignore[return-value]


def job_ids_in_queue(slurm: S.Slurm) -> list[str]:
    return [line.split()[0] for line in slurm.queue()]


# ---------------------------------------------------------------- job scripts


GOLDEN_CASES = {
    "slurm-cpu": {
        "queue": "batch",
        "account": "proj42",
        "walltime": "02:00:00",
        "cores": 8,
        "memory": "32GiB",
        "processes": 2,
        "interface": "ib0",
        "python": "/opt/venv/bin/python",
        "local_directory": "/scratch/$USER",
        "log_directory": "/shared/logs/dask",
        "prologue": ["module load python/3.11"],
        "env": {"OMP_NUM_THREADS": "4"},
        "job_extra": ["--exclusive"],
    },
    "slurm-gpu": {
        "queue": "gpu",
        "account": "proj42",
        "walltime": "1-00:00:00",
        "cores": 16,
        "memory": "128GiB",
        "processes": 2,
        "interface": "ib0",
        "python": "/opt/venv/bin/python",
        "worker": {"gpus": 1},
        "prologue": ["module load cuda/12.4"],
    },
    "slurm-gpus-per-task": {
        "queue": "gpu",
        "walltime": "04:00:00",
        "cores": 8,
        "memory": "64GiB",
        "python": "/opt/venv/bin/python",
        "worker": {"gpus": 1},
        "gpu_directive": "gpus-per-task",
        "scheduler": {"host": "10.0.0.5"},
    },
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_job_script(case: str) -> None:
    profile = SLURMProfile.model_validate({"backend": "slurm", **GOLDEN_CASES[case]})
    script = SLURM.render(profile.named(case), ClusterSecurity())
    path = GOLDEN / f"{case}.sh"
    if UPDATE_GOLDEN:
        path.write_text(script)
    assert script == path.read_text(), (
        f"re-run with CLUSTERKIT_UPDATE_GOLDEN=1 to accept:\n{script}"
    )


def test_render_is_pure_and_shows_gpu_worker(tmp_path: Path) -> None:
    logs = tmp_path / "not-made"
    profile = model(tmp_path, log_directory=str(logs), worker={"gpus": 1}, processes=2, cores=4)
    script = SLURM.render(profile, ClusterSecurity())
    assert not logs.exists(), "render must not create the log directory"
    assert "#SBATCH --gres=gpu:2" in script
    assert "-m dask_cuda.cli tcp://<scheduler-address>:8786" in script
    assert "--resources GPU=1" in script and "--nanny" not in script
    lifetime, _ = lifetime_plan(profile)
    assert f"DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION={int(lifetime)}s" in script


def test_render_tls_and_ucx() -> None:
    profile = SLURMProfile.model_validate({"backend": "slurm", "protocol": "tls"}).named("t")
    tls = ClusterSecurity.from_files("/c/ca.pem", "/c/cert.pem", "/c/key.pem")
    script = SLURM.render(profile, tls)  # type: ignore[arg-type]
    assert "tls://<scheduler-address>:8786" in script
    assert "--tls-ca-file /c/ca.pem --tls-cert /c/cert.pem --tls-key /c/key.pem" in script
    profile = SLURMProfile.model_validate({"backend": "slurm", "protocol": "ucx"}).named("u")
    script = api.render(profile)
    assert "ucx://<scheduler-address>" in script and "export UCX_TLS=tcp" in script


def test_lifetime_defaults_stay_below_walltime() -> None:
    for walltime in ("00:01:00", "00:30:00", "01:00:00", "2-00:00:00"):
        profile = SLURMProfile.model_validate({"backend": "slurm", "walltime": walltime})
        lifetime, stagger = lifetime_plan(profile)  # type: ignore[arg-type]
        total = {"00:01:00": 60, "00:30:00": 1800, "01:00:00": 3600, "2-00:00:00": 172800}
        assert stagger > 0 and lifetime + stagger < total[walltime]
        assert lifetime >= total[walltime] / 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"processes": 4, "cores": 2}, "processes (4) is above cores (2)"),
        ({"worker": {"gpus": 2}}, "one worker per GPU"),
        ({"worker": {"threads": 4}}, "worker.threads (4) is above the cores each worker has"),
        ({"worker": {"memory": "2GiB"}}, "worker.memory is derived"),
        ({"walltime": "00:10:00", "lifetime": "10m"}, "must be below the walltime"),
        ({"walltime": "10:00"}, "expected a walltime"),
    ],
)
def test_profile_rejects(fields: dict[str, Any], message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape(message)):
        SLURMProfile.model_validate({"backend": "slurm", **fields})


def test_render_matches_the_submitted_script(slurm: S.Slurm, tmp_path: Path) -> None:
    """What `profiles render` prints is what the cluster submits, address and name aside."""
    profile = model(tmp_path, workers=0, env={"A": "b c"}, prologue=["echo hi"])
    rendered = SLURM.render(profile, ClusterSecurity())
    cluster: Any = SLURM.create(profile, ClusterSecurity(), name=profile.name)
    try:
        actual = cluster.job_script()
        actual = actual.replace(
            cluster.scheduler_address.rsplit(":", 1)[0], "tcp://<scheduler-address>"
        )
        actual = re.sub(r"<scheduler-address>:\d+", "<scheduler-address>:8786", actual)
        actual = actual.replace("--name dummy-name", "--name <worker-name>")
        actual = actual.replace(cluster.job_name, f"ck-{profile.name}-<id>")  # the cluster's tag
        assert actual == rendered
        assert "export A='b c'" in rendered
    finally:
        cluster.close()


# ---------------------------------------------------------------- lifecycle


def test_contract_slurm(slurm: S.Slurm, tmp_path: Path) -> None:
    path = profile_file(tmp_path, "contract")
    record = run_contract(path, scale_to=2)
    assert record.address.startswith("tls://127.0.0.1:")  # mutual TLS by default
    assert record.backend == "slurm"


def test_status_rows_jobs_and_workers_in_their_own_jobs(slurm: S.Slurm, tmp_path: Path) -> None:
    record = api.up(profile_file(tmp_path, "rows", workers=2))
    try:
        info = api.status(record.name)
        jobs = [row for row in info["rows"] if row["kind"] == "job"]
        assert len(jobs) == 2 and {row["state"] for row in jobs} == {"RUNNING"}
        assert sorted(row["name"] for row in jobs) == sorted(job_ids_in_queue(slurm))
        with get_client(record.name) as client:
            seen = client.run(lambda: os.environ.get("SLURM_JOB_ID"))
        assert sorted(seen.values()) == sorted(row["name"] for row in jobs)
    finally:
        api.down(record.name)
    assert slurm.queue() == [], "down left jobs in the queue"


def test_logs_of_a_job_show_its_own_log_file(slurm: S.Slurm, tmp_path: Path) -> None:
    import subprocess
    import sys

    from clusterkit.errors import BadInput

    path = profile_file(tmp_path, "joblog", prologue=["echo prologue ran for $SLURM_JOB_ID >&2"])
    record = api.up(path)
    try:
        (job,) = [row["name"] for row in api.status(record.name)["rows"] if row["kind"] == "job"]
        logs = api.logs(record.name, component=f"job {job}")
        assert list(logs) == [f"job {job}"]
        text = "\n".join(logs[f"job {job}"])
        assert f"prologue ran for {job}" in text  # before the worker existed
        assert "Starting Worker" in text or "Start worker" in text, text
        assert f"job {job}" in api.logs(record.name)  # every component, the jobs included
        recent = "\n".join(api.logs(record.name, component=f"job {job}", since="10m")[f"job {job}"])
        assert f"prologue ran for {job}" in recent  # unstamped, before the worker's first line
        with pytest.raises(BadInput, match=f"its jobs in the queue: {job}"):
            api.logs(record.name, component="job 999999")
        cli = [sys.executable, "-m", "clusterkit", "logs", record.name, "-c", f"job {job}"]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"==> job {job} <==") and "prologue ran" in done.stdout
    finally:
        api.down(record.name)


def test_logs_of_a_finished_job_without_a_log_directory(
    slurm: S.Slurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No log_directory: the job wrote slurm-ID.out where `up` ran; once SLURM has forgotten
    the job (MinJobAge), `logs -c 'job ID'` still finds that file."""
    monkeypatch.chdir(tmp_path)
    record = api.up(profile_file(tmp_path, "joblog-cwd", log_directory=None))
    try:
        (job,) = job_ids_in_queue(slurm)
        deadline = time.monotonic() + 60
        while not (tmp_path / f"slurm-{job}.out").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        slurm.run("scancel", job)
        deadline = time.monotonic() + 60
        while slurm.run("scontrol", "show", "job", job).returncode == 0:
            assert time.monotonic() < deadline, "SLURM still knows the job after 60 s"
            time.sleep(0.5)
        text = "\n".join(api.logs(record.name, component=f"job {job}")[f"job {job}"])
        assert "dask" in text.lower() or "worker" in text.lower(), text
    finally:
        api.down(record.name)


def test_rejected_job_script_gives_sbatch_stderr(slurm: S.Slurm, tmp_path: Path) -> None:
    with pytest.raises(ClusterStartError) as caught:
        api.up(profile_file(tmp_path, "badpart", queue="no-such-partition"))
    error = caught.value
    assert error.exit_code == 1
    assert "invalid partition" in error.message.lower(), error.message
    assert error.component == "slurm job submission"
    assert slurm.queue() == []


@pytest.mark.parametrize("path_kind", ["up", "embedded"])
def test_pending_at_start_timeout_gives_reason_and_cancels(
    slurm: S.Slurm, tmp_path: Path, path_kind: str
) -> None:
    path = profile_file(tmp_path, "pending", job_extra=["--begin=now+3600"], start_timeout=6)
    start = api.up if path_kind == "up" else get_client
    with pytest.raises(ClusterStartError, match="BeginTime") as caught:  # reason in the message
        start(path)
    text = "\n".join(caught.value.evidence)
    assert "PENDING" in text and "BeginTime" in text, text
    assert slurm.empty_queue(timeout=0) == [], "jobs of a failed start were not cancelled"


def test_supervisor_killed_while_jobs_pend_leaves_no_job(slurm: S.Slurm, tmp_path: Path) -> None:
    """A job still pending has no worker to notice its scheduler is gone: killed mid-start, the
    supervisor's claim (written before any submission, with the job name) lets `down` cancel
    it."""
    import signal
    import subprocess
    import sys

    from clusterkit import state

    path = profile_file(tmp_path, "pend-kill", job_extra=["--begin=now+3600"], start_timeout=60)
    cli = [sys.executable, "-m", "clusterkit"]
    up = subprocess.Popen([*cli, "up", str(path), "--name", "pend-kill"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not job_ids_in_queue(slurm):
            assert up.poll() is None and time.monotonic() < deadline, "no job was submitted"
            time.sleep(0.05)
        claim = state.read_record("pend-kill")
        assert claim is not None and claim.starting
        assert claim.extra["job_name"].startswith("ck-pend-kill-")
        os.kill(claim.pid or 0, signal.SIGKILL)
        up.wait(60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    subprocess.run([*cli, "down", "pend-kill"], capture_output=True, timeout=120)
    assert slurm.queue() == [], "a pending job outlived its cluster"
    assert state.read_record("pend-kill") is None


def test_pending_reason_in_status(slurm: S.Slurm, tmp_path: Path) -> None:
    profile = model(tmp_path, "held", workers=1, job_extra=["--hold"])
    cluster: Any = SLURM.create(profile, ClusterSecurity(), name=profile.name)
    try:
        rows = SLURM.describe(cluster, profile)
        assert [(r.state, r.extra["reason"]) for r in rows] == [("PENDING", "JobHeldUser")]
    finally:
        cluster.close()
    assert getattr(cluster, "jobs_left", []) == []


def test_adapt_up_and_down(slurm: S.Slurm, tmp_path: Path) -> None:
    path = profile_file(tmp_path, "adapt", workers=0, adapt={"minimum": 0, "maximum": 2})
    record = api.up(path)
    try:
        assert job_ids_in_queue(slurm) == []
        with get_client(record.name) as client:
            futures = client.map(lambda x: time.sleep(4) or x, range(8))
            assert sum(client.gather(futures)) == 28
            assert len(job_ids_in_queue(slurm)) >= 1
            del futures
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and (
                client.scheduler_info(n_workers=-1)["workers"] or job_ids_in_queue(slurm)
            ):
                time.sleep(0.5)
            assert not client.scheduler_info(n_workers=-1)["workers"]
        assert job_ids_in_queue(slurm) == [], "adapt left idle jobs"
    finally:
        api.down(record.name)


HPO_OBJECTIVE = textwrap.dedent("""
    def objective(trial):
        import os, time
        x = trial.suggest_float("x", -5, 5)
        trial.set_user_attr("job", os.environ.get("SLURM_JOB_ID"))
        time.sleep(1.0)
        return (x - 1) ** 2
""")


def test_short_lifetime_replaces_workers_during_hpo(
    slurm: S.Slurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers leave at their lifetime; their jobs are replaced; no trial is lost."""
    import optuna

    from clusterkit.runners import hpo

    monkeypatch.setenv("DASK_DISTRIBUTED__DEPLOY__LOST_WORKER_TIMEOUT", "1s")  # supervisor's
    path = profile_file(
        tmp_path,
        "lifetime",
        workers=2,
        walltime="00:05:00",
        lifetime="12s",
        lifetime_stagger="3s",
    )
    namespace: dict[str, Any] = {}
    exec(HPO_OBJECTIVE, namespace)  # a plain function, pickled by value to the workers
    record = api.up(path)
    try:
        with get_client(record.name) as client:
            study = hpo.run(
                namespace["objective"],
                n_trials=40,
                client=client,
                progress=False,
                storage=f"sqlite:///{tmp_path / 'hpo.db'}",
                study_name="lifetime",
                max_retries=5,
            )
        states = [t.state for t in study.trials]
        assert states.count(optuna.trial.TrialState.COMPLETE) == 40, states
        assert len(study.trials) == 40, "a trial was lost or duplicated"
        jobs = {t.user_attrs.get("job") for t in study.trials}
        assert len(jobs) > 2, f"no job was replaced: trials ran in jobs {jobs}"
    finally:
        api.down(record.name)


RANK_FN = textwrap.dedent("""
    def rank_fn(ctx):
        import os
        import torch
        import torch.distributed as dist

        value = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(value)
        return {"rank": ctx.rank, "sum": value.item(), "job": os.environ.get("SLURM_JOB_ID")}
""")


def test_ddp_two_ranks_in_two_jobs(slurm: S.Slurm, tmp_path: Path) -> None:
    from clusterkit.runners import ddp

    namespace: dict[str, Any] = {}
    exec(RANK_FN, namespace)  # pickled by value: the jobs need not import this test module
    record = api.up(profile_file(tmp_path, "ddp", workers=2, memory="2GiB"))
    try:
        with get_client(record.name) as client:
            results = ddp.run(namespace["rank_fn"], client=client, world_size=2, timeout=180)
        assert [r["rank"] for r in results] == [0, 1]
        assert {r["sum"] for r in results} == {3.0}
        assert len({r["job"] for r in results}) == 2, results
    finally:
        api.down(record.name)


def test_bundled_slurm_gpu_profile_renders() -> None:
    script = api.render("slurm-gpu")
    assert "#SBATCH --gres=gpu:2" in script and "#SBATCH -J ck-slurm-gpu-<id>" in script
    assert "--resources GPU=1" in script and "--tls-key <cluster-dir>/worker-key.pem" in script
    assert "~" not in script.split("\n#SBATCH -p")[0], "log paths must be expanded"


def test_tls_jobs_join_and_a_client_without_certificates_is_refused(
    slurm: S.Slurm, tmp_path: Path
) -> None:
    from distributed import Client

    record = api.up(profile_file(tmp_path, "tls", protocol="tls"))
    try:
        assert record.address.startswith("tls://127.0.0.1:")
        with get_client(record.name) as client:
            assert client.submit(sum, [1, 2]).result(timeout=30) == 3
            scripts = client.run(lambda: os.environ.get("SLURM_JOB_ID"))
            assert all(scripts.values())
        with pytest.raises(OSError):  # a plain-TCP client never gets a connection
            Client(record.address.replace("tls://", "tcp://"), timeout=3)
    finally:
        api.down(record.name)


def test_doctor_checks_sbatch_and_partition(slurm: S.Slurm, tmp_path: Path) -> None:
    checks = {c.name: c for c in SLURM.doctor(model(tmp_path), ClusterSecurity())}
    assert checks["sbatch on PATH"].ok
    assert checks[f"slurm queue '{S.PARTITION}'"].ok
    bad = {c.name: c for c in SLURM.doctor(model(tmp_path, queue="gpu-nope"), ClusterSecurity())}
    assert not bad["slurm queue 'gpu-nope'"].ok


def test_job_that_dies_gives_its_stderr(slurm: S.Slurm, tmp_path: Path) -> None:
    path = profile_file(tmp_path, "nopython", python="/nonexistent/bin/python", start_timeout=8)
    with pytest.raises(ClusterStartError) as caught:
        api.up(path)
    text = "\n".join(caught.value.evidence)
    assert "/nonexistent/bin/python" in text and "No such file" in text, text


def test_killed_supervisor_leaves_jobs_named_for_the_cluster_that_down_cancels(
    slurm: S.Slurm, tmp_path: Path
) -> None:
    import signal

    import psutil

    from clusterkit import state

    record = api.up(profile_file(tmp_path, "orphan-jobs", workers=1))
    assert record.extra["job_name"].startswith("ck-orphan-jobs-")
    os.kill(record.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(record.pid)], timeout=10)
    queued = slurm.run("squeue", "-h", "-o", "%i %j").stdout.split("\n")
    queued = [line for line in queued if line.strip()]
    assert queued and all(record.extra["job_name"] in line for line in queued), queued
    api.down(record.name)
    assert slurm.queue() == [], "down left the dead cluster's jobs in the queue"
    assert state.load_record(record.name) is None


def test_jobs_end_by_themselves_when_their_scheduler_is_gone(
    slurm: S.Slurm, tmp_path: Path
) -> None:
    """The scheduler runs in the supervisor: SIGKILL it, and each job's worker must exit after
    death_timeout, ending its job, with no clusterkit process left to cancel anything."""
    import signal

    import psutil

    record = api.up(profile_file(tmp_path, "headless-jobs", workers=2, death_timeout="5s"))
    assert len(job_ids_in_queue(slurm)) == 2
    os.kill(record.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(record.pid)], timeout=10)
    started = time.monotonic()
    while slurm.queue() and time.monotonic() - started < 90:
        time.sleep(0.2)
    took = time.monotonic() - started
    assert slurm.queue() == [], f"jobs still queued {took:.0f}s after their scheduler died"
    print(f"SLURM jobs ended {took:.1f}s after their scheduler died (death_timeout 5s)")
    api.down(record.name)


def test_project_directory_runs_in_place_on_the_shared_disk(slurm: S.Slurm, tmp_path: Path) -> None:
    """Jobs see the submitter's disk: detected per worker (same path, same digests), the
    example project runs in place and its second run resumes from the snapshot it wrote in
    the user's directory; an objective imports its sibling module."""
    from tests.test_workdir import example_project_on

    record = api.up(profile_file(tmp_path, "wd", workers=2, memory="2GiB"))
    try:
        with get_client(record.name) as client:
            assert example_project_on(client, tmp_path, copy=False) == {"in-place"}
    finally:
        api.down(record.name)
