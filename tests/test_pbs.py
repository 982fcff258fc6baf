"""The pbs backend: job scripts (golden) and the qsub / qstat / qdel command lines it runs.

Debian packages no PBS server (infra.md §3b), so the batch commands here are small stand-ins
on PATH that record each call and run the submitted script as a local process. What is under
test is ours and dask-jobqueue's: the script, the command lines, job-id parsing, state rows,
rejection handling and cancellation. A real PBS site is needed for PBS's own behaviour.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterkit.backends.jobqueue.pbs import PBSBackend
from clusterkit.errors import ClusterStartError
from clusterkit.schema import PBSProfile
from clusterkit.security import ClusterSecurity

PBS = PBSBackend()

pytestmark = pytest.mark.pbs

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("CLUSTERKIT_UPDATE_GOLDEN") == "1"

QSUB = """\
#!/usr/bin/env bash
# stand-in qsub: record the call, keep the script, run it in its own session, print the id
set -euo pipefail
D="{state}"
echo "qsub $*" >> "$D/calls"
if [ -n "${{PBS_STUB_REJECT:-}}" ]; then echo "$PBS_STUB_REJECT" >&2; exit 1; fi
script="${{@: -1}}"
# jobs are submitted concurrently: allocate the id under a lock
n=$(flock "$D/lock" bash -c 'n=$(( $(cat "$1/next" 2>/dev/null || echo 0) + 1 )); \
    echo "$n" > "$1/next"; echo "$n"' _ "$D")
cp "$script" "$D/$n.sh"
PBS_JOBID="$n.pbs-stub" setsid bash "$D/$n.sh" > "$D/$n.out" 2> "$D/$n.err" < /dev/null &
echo $! > "$D/$n.pid"
echo "$n.pbs-stub"
"""
QSTAT = """\
#!/usr/bin/env bash
# stand-in qstat -f ID: a PBS Pro style block while the job's process lives, else unknown
D="{state}"
echo "qstat $*" >> "$D/calls"
id="${{@: -1}}"; n="${{id%%.*}}"
if [ -f "$D/$n.pid" ] && kill -0 "$(cat "$D/$n.pid")" 2>/dev/null; then
  printf 'Job Id: %s.pbs-stub\\n    job_state = R\\n    exec_host = %s/0\\n' "$n" "$(hostname -s)"
  printf '    Error_Path = %s:%s/%s.err\\n' "$(hostname -s)" "$D" "$n"
else
  echo "qstat: Unknown Job Id $id" >&2; exit 153
fi
"""
QDEL = """\
#!/usr/bin/env bash
# stand-in qdel ID...: record, end each job's process group
D="{state}"
echo "qdel $*" >> "$D/calls"
for id in "$@"; do
  n="${{id%%.*}}"
  [ -f "$D/$n.pid" ] && kill -TERM -- "-$(cat "$D/$n.pid")" 2>/dev/null || true
done
"""

PBSDSH = """\
#!/usr/bin/env bash
# stand-in pbsdsh -n INDEX -- PROGRAM ARGS: record, run the task here (one node)
D="{state}"
echo "pbsdsh $*" >> "$D/calls"
[ "$1" = "-n" ] && [ "$3" = "--" ] || {{ echo "pbsdsh: usage" >&2; exit 2; }}
shift 3
exec "$@"
"""


@pytest.fixture
def pbs_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """qsub/qstat/qdel stand-ins first on PATH; yields their state directory (calls, logs)."""
    state = tmp_path / "pbs-state"
    state.mkdir()
    bin_dir = tmp_path / "pbs-bin"
    bin_dir.mkdir()
    for name, text in (("qsub", QSUB), ("qstat", QSTAT), ("qdel", QDEL), ("pbsdsh", PBSDSH)):
        path = bin_dir / name
        path.write_text(text.format(state=state))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    yield state


def calls(state: Path) -> list[str]:
    path = state / "calls"
    return path.read_text().splitlines() if path.exists() else []


def model(tmp_path: Path, name: str = "pb", **fields: Any) -> PBSProfile:
    data: dict[str, Any] = {
        "backend": "pbs",
        "queue": "workq",
        "workers": 2,
        "cores": 1,
        "memory": "1GiB",
        "walltime": "00:10:00",
        "start_timeout": 60,
        "scheduler": {"dashboard": False},
        "log_directory": str(tmp_path / "joblogs"),
    }
    data.update(fields)
    return PBSProfile.model_validate(data).named(name)  # type: ignore[return-value]


# ---------------------------------------------------------------- job scripts

GOLDEN_CASES = {
    "pbs-cpu": {
        "queue": "workq",
        "account": "proj42",
        "walltime": "1-06:00:00",
        "cores": 8,
        "memory": "32GiB",
        "processes": 4,
        "interface": "ib0",
        "python": "/opt/venv/bin/python",
        "log_directory": "/shared/logs/dask",
        "prologue": ["module load python/3.11"],
        "job_extra": ["-j oe"],
    },
    "pbs-gpu": {
        "queue": "gpuq",
        "walltime": "04:00:00",
        "cores": 16,
        "memory": "128GiB",
        "processes": 2,
        "python": "/opt/venv/bin/python",
        "worker": {"gpus": 1},
        "interface": "ib0",
        "prologue": ["module load cuda/12.4"],
        "protocol": "ucx",
        "ucx": {"infiniband": True, "nvlink": True},
    },
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_job_script(case: str) -> None:
    from clusterkit import api

    profile = PBSProfile.model_validate({"backend": "pbs", **GOLDEN_CASES[case]}).named(case)
    script = api.render(profile)
    path = GOLDEN / f"{case}.sh"
    if UPDATE_GOLDEN:
        path.write_text(script)
    assert script == path.read_text(), f"CLUSTERKIT_UPDATE_GOLDEN=1 accepts:\n{script}"


def test_resources_and_walltime_in_pbs_terms() -> None:
    profile = PBSProfile.model_validate(
        {
            "backend": "pbs",
            "cores": 8,
            "memory": "64GiB",
            "processes": 2,
            "worker": {"gpus": 1},
            "walltime": "2-01:30:00",
        }
    ).named("r")
    script = PBS.render(profile, ClusterSecurity())
    assert "#PBS -l select=1:ncpus=8:mem=64GB:ngpus=2" in script
    assert "#PBS -l walltime=49:30:00" in script  # PBS has no days field
    spec = "select=1:ncpus=8:ngpus=2:gpu_model=a100"
    custom = profile.model_copy(update={"resource_spec": spec})
    assert f"#PBS -l {spec}" in PBS.render(custom, ClusterSecurity())


def test_qstat_full_is_parsed() -> None:
    from clusterkit.backends.jobqueue.pbs import parse_qstat_full

    text = (  # PBS Pro wraps long values onto lines that start with a tab
        "Job Id: 17.server\n"
        "    Job_Name = clusterkit\n"
        "    job_state = Q\n"
        "    comment = Not Running: Insufficient amount of resource: ngpus (R: 2 A: 0 T: 8\n"
        "\t)\n"
        "    Error_Path = login1:/home/me/clusterkit.e17\n"
    )
    info = parse_qstat_full("17", text)
    assert info.state == "Q"
    assert info.reason == "Not Running: Insufficient amount of resource: ngpus (R: 2 A: 0 T: 8)"
    assert info.stderr_path == "/home/me/clusterkit.e17"


#: `qstat -f` of a running job in PBS Pro's format (as sites print it: four-space attributes,
#: tab-led continuations, ctime-style times with a space-padded day), shortened
QSTAT_RUNNING = (
    "Job Id: 4711.pbs01\n"
    "    Job_Name = ck-demo-ab12\n"
    "    resources_used.walltime = 00:12:04\n"
    "    job_state = R\n"
    "    ctime = Tue May  7 09:31:20 2019\n"
    "    exec_host = cn02/0*16\n"
    "    exec_vnode = (cn02:ncpus=16:mem=1048576kb:ngpus=0)+(cn03:ncpus=16:mem=1048576kb:ng\n"
    "\tpus=0)\n"
    "    qtime = Tue May  7 09:31:20 2019\n"
    "    stime = Tue May  7 09:31:21 2019\n"
    "    comment = Job run at Tue May 07 at 09:31 on (cn02:ncpus=16:mem=1048576kb:ngpus=0\n"
    "\t)\n"
)


def test_the_job_start_is_qstat_fs_stime() -> None:
    """PBS cannot run here: the parsing of `qstat -f`'s start on its real format (PBS Pro's
    ``stime``; Torque's ``start_time``), and the job id from inside a job (``PBS_JOBID``)."""
    from datetime import datetime

    from clusterkit.backends.jobqueue.pbs import PBSQueue

    queue = PBSQueue()
    started = datetime(2019, 5, 7, 9, 31, 21).timestamp()  # local time, as qstat prints it
    assert queue.parse_start(QSTAT_RUNNING) == started
    torque = QSTAT_RUNNING.replace("    stime = ", "    start_time = ")
    assert queue.parse_start(torque) == started
    queued = "Job Id: 4712.pbs01\n    job_state = Q\n    qtime = Tue May  7 09:31:20 2019\n"
    assert queue.parse_start(queued) is None
    assert queue.start_command("4711.pbs01") == ["qstat", "-f", "4711.pbs01"]
    assert queue.job_here({"PBS_JOBID": "4711.pbs01"}) == "4711.pbs01"
    assert queue.job_here({"JOB_ID": "12", "SLURM_JOB_ID": "13"}) is None


# ---------------------------------------------------------------- command lines


def test_submit_status_cancel_command_lines(pbs_bin: Path, tmp_path: Path) -> None:
    from distributed import Client

    profile = model(tmp_path)
    rendered = PBS.render(profile, ClusterSecurity())
    cluster: Any = PBS.create(profile, ClusterSecurity(), name=profile.name)
    try:
        submits = [c for c in calls(pbs_bin) if c.startswith("qsub")]
        assert len(submits) == 2
        assert all(re.fullmatch(r"qsub /\S+\.sh", c) for c in submits), submits
        script = (pbs_bin / "1.sh").read_text()
        normal = re.sub(r"tcp://127\.0\.0\.1:\d+", "tcp://<scheduler-address>:8786", script)
        normal = re.sub(r"--name pb-\d+", "--name <worker-name>", normal)
        normal = normal.replace(cluster.job_name, f"ck-{profile.name}-<id>")  # the cluster's tag
        assert normal == rendered
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            assert client.submit(sum, [1, 2]).result(timeout=30) == 3
        rows = PBS.describe(cluster, profile)
        assert sorted((r.name, r.state) for r in rows) == [("1", "R"), ("2", "R")]
        assert "qstat -f 1" in calls(pbs_bin)
    finally:
        cluster.close()
    assert {"qdel 1", "qdel 2"} <= set(calls(pbs_bin))
    assert getattr(cluster, "jobs_left", []) == []


def test_rejected_submission_gives_qsub_stderr(
    pbs_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PBS_STUB_REJECT", "qsub: Unknown queue MSG=requested queue not found")
    with pytest.raises(ClusterStartError) as caught:
        PBS.create(model(tmp_path, queue="nope"), ClusterSecurity(), name="test")
    assert "Unknown queue" in caught.value.message
    assert caught.value.exit_code == 1
    assert [c for c in calls(pbs_bin) if c.startswith("qdel")] == []


def test_evidence_names_job_state_and_stderr(pbs_bin: Path, tmp_path: Path) -> None:
    profile = model(tmp_path, workers=1)
    cluster: Any = PBS.create(profile, ClusterSecurity(), name=profile.name)
    try:
        from distributed import Client

        with Client(cluster) as client:
            client.wait_for_workers(1, timeout=60)
        lines = PBS.evidence(cluster, profile)
        assert lines[0] == "job 1: R"
        assert any("distributed.worker" in line for line in lines[1:]), lines  # its stderr
    finally:
        cluster.close()


def test_bundled_pbs_gpu_profile_renders() -> None:
    from clusterkit import api

    script = api.render("pbs-gpu")
    assert "#PBS -l select=1:ncpus=16:mem=128GB:ngpus=2" in script
    assert "-m dask_cuda.cli tls://<scheduler-address>:8786" in script
    assert "--tls-key <cluster-dir>/worker-key.pem" in script  # the workers' own key


def test_logs_of_a_job_find_its_file_in_the_log_directory(tmp_path: Path) -> None:
    """Without a PBS server here, `qstat -f` cannot name the file: PBS's own naming in the
    profile's log directory (`{job_name}.e{id}`) finds it, and an unknown job is one line."""
    from clusterkit.errors import BadInput
    from clusterkit.state import ClusterRecord

    (tmp_path / "ck-pb-1a2b.e4242").write_text("module: command not found\nStart worker\n")
    record = ClusterRecord(
        name="pb",
        backend="pbs",
        profile="pb",
        profile_source=None,
        digest="",
        address="tcp://127.0.0.1:1",
        dashboard=None,
        pid=None,
        security={},
        min_workers=0,
        extra={"job_name": "ck-pb-1a2b", "log_directory": str(tmp_path)},
    )
    logs = PBSBackend().component_logs(record, "job 4242", lines=50)
    assert logs == {"job 4242": ["module: command not found", "Start worker"]}
    with pytest.raises(BadInput, match="no job '77' of cluster 'pb'"):
        PBSBackend().component_logs(record, "job 77", lines=50)
    assert PBSBackend().component_logs(record, "scheduler", lines=50) == {}


# ---------------------------------------------------------------- a whole run in one job


def test_a_batch_search_runs_in_one_job_with_a_worker_per_chunk(
    pbs_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hpo --batch`` on PBS: one qsub, a select= line with one chunk per worker, the
    workers started with pbsdsh on the allocation's chunks, the search to its end."""
    import subprocess
    import textwrap

    import yaml

    from clusterkit import runs

    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    data = model(tmp_path).model_dump(mode="json", exclude={"name"}, exclude_none=True)
    (tmp_path / "pb.yaml").write_text(yaml.safe_dump({**data, "requeue": True}))
    objective = "def objective(trial):\n    return trial.suggest_float('x', 0, 1)\n"
    (tmp_path / "search.py").write_text(textwrap.dedent(objective))
    done = subprocess.run(
        ["clusterkit", "hpo", "search.py:objective", "-n", "6", "-p", "pb.yaml", "--batch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    assert runs.wait(run_id, timeout=120) == 0, runs.get(run_id).log.read_text()
    made = calls(pbs_bin)
    assert sum(line.startswith("qsub") for line in made) == 1
    tasks = sorted(line.split(" -- ")[0] for line in made if line.startswith("pbsdsh"))
    assert tasks == ["pbsdsh -n 0", "pbsdsh -n 1"]
    script = (pbs_bin / "1.sh").read_text()
    assert "#PBS -l select=2:ncpus=1:mem=1024mb" in script and "#PBS -r y" in script
    assert f"#PBS -N {run_id}\n" in script  # the run's identity in PBS's 15 characters
    assert runs.show(run_id)["target"].startswith("pbs job 1.pbs-stub")
