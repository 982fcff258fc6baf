"""The sge backend against a real single-node Grid Engine (qmaster + execd, tests/sge.py)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from clusterkit import api, state
from clusterkit.backends.jobqueue.sge import SGEBackend, output_path, parse_qstat_j, pending_reason
from clusterkit.errors import BadInput, ClusterStartError
from clusterkit.schema import SGEProfile
from clusterkit.security import ClusterSecurity
from tests import sge as G
from tests import test_commandlines as C
from tests.contract import run_contract, runners

SGE = SGEBackend()

pytestmark = pytest.mark.sge


def profile_data(tmp_path: Path, **fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "backend": "sge",
        "queue": G.QUEUE,
        "workers": 1,
        "cores": 1,
        "memory": "1GiB",
        "walltime": "00:10:00",
        "log_directory": str(tmp_path / "joblogs"),
        "start_timeout": 90,
        "scheduler": {"dashboard": False},
    }
    return {**data, **fields}


def profile_file(tmp_path: Path, name: str, **fields: Any) -> Path:
    import yaml

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(profile_data(tmp_path, **fields)))
    return path


def model(tmp_path: Path, name: str, **fields: Any) -> SGEProfile:
    return SGEProfile.model_validate(profile_data(tmp_path, **fields)).named(name)  # type: ignore[return-value]


# ---------------------------------------------------------------- without a cell


def test_job_script_directives(tmp_path: Path) -> None:
    profile = model(
        tmp_path, "gpu", cores=4, processes=2, memory="16GiB", parallel_environment="smp",
        memory_resource="h_vmem", gpu_resource="gpu_card", worker={"gpus": 1},
        account="proj", walltime="1-00:00:00",
    )  # fmt: skip
    script = SGE.render(profile, ClusterSecurity())
    wanted = ["-N ck-gpu-<id>", "-q all.q", "-P proj", "-l h_rt=24:00:00", "-pe smp 4",
              "-l h_vmem=4096M", "-l gpu_card=2", "-j y", f"-o {tmp_path}/joblogs/"]  # fmt: skip
    for line in wanted:
        assert f"#$ {line}\n" in script, (line, script)
    assert "-m dask_cuda.cli " in script and "--resources GPU=1" in script


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cores": 2}, "needs parallel_environment"),
        ({"gpu_resource": "gpu card"}, "gpu_resource"),
        ({"memory_resource": "-l"}, "memory_resource"),
    ],
)
def test_profile_rejects(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model(tmp_path, "bad", **fields)


WORKER_CASES = [(variant, gpus) for variant in C.VARIANTS for gpus in (0, 1)]


@pytest.mark.parametrize("case", WORKER_CASES, ids=[C.case_id(c) for c in WORKER_CASES])
def test_worker_command_parses(
    case: tuple[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's worker command goes to Dask's or dask-cuda's own parser (test_commandlines)."""
    monkeypatch.setattr(C, "TLS_STAND_INS", tmp_path)
    variant, gpus = case
    data = {**C.jobqueue_profile("sge", variant, gpus), "parallel_environment": "smp"}
    script = C.rendered(tmp_path, f"sge-{variant}", {**data, "processes": 2})
    module, ctx = C.parse_python(C.worker_line(script))
    assert module == ("dask_cuda.cli" if gpus else "distributed.cli.dask_worker")
    scheme = C.VARIANTS[variant].get("protocol", "tls")
    assert ctx.params["protocol"] == f"{scheme}://"
    assert ("GPU=1" in (ctx.params["resources"] or "")) == bool(gpus)
    assert ("#$ -l gpu=2" in script) == bool(gpus)
    C.check_lifetime(script, ctx.params, variant, gpus)


QSTAT_J = """\
==============================================================
job_number:                 7
job_name:                   ck-demo-ab12
stdout_path_list:           NONE:NONE:/logs/
sge_o_workdir:              /home/me
hard resource_list:         h_rt=600,arch=nowhere
scheduling info:            (-l arch=nowhere) cannot run in queue "all.q@vm" because it \
offers only hl:arch=lx-amd64
                            (-l arch=nowhere) cannot run in queue "b.q@vm" because ...
"""


def test_qstat_j_gives_reason_and_log_path() -> None:
    fields = parse_qstat_j(QSTAT_J)
    assert pending_reason(fields) == (
        '(-l arch=nowhere) cannot run in queue "all.q@vm" because it offers only hl:arch=lx-amd64'
    )
    assert output_path(fields, "7") == "/logs/ck-demo-ab12.o7"
    errored = parse_qstat_j("job_name: x\nerror reason    1:  can't chdir to /nope\n")
    assert pending_reason(errored) == "can't chdir to /nope"
    assert output_path({**fields, "stdout_path_list": "NONE"}, "7") == "/home/me/ck-demo-ab12.o7"


#: `qstat -j ID -xml` of a running job (this Grid Engine, 8.1.9), shortened: the task's start
QSTAT_J_XML = """<?xml version='1.0'?>
<detailed_job_info  xmlns:xsd="http://arc.liv.ac.uk/repos/darcs/sge/source/dist/util/resources/\
schemas/qstat/detailed_job_info.xsd">
  <djob_info>
    <element>
      <JB_job_number>130</JB_job_number>
      <JB_submission_time>1795759824</JB_submission_time>
      <JB_ja_tasks>
        <ulong_sublist>
          <JAT_status>128</JAT_status>
          <JAT_task_number>1</JAT_task_number>
          <JAT_start_time>1795759825</JAT_start_time>
        </ulong_sublist>
      </JB_ja_tasks>
      <JB_execution_time>0</JB_execution_time>
    </element>
  </djob_info>
</detailed_job_info>
"""


def test_the_job_start_is_its_tasks_start() -> None:
    """``qstat -j ID -xml``: the task's JAT_start_time (seconds; milliseconds in Univa/Altair
    Grid Engine), not the submission; none before the job runs; ``JOB_ID`` only in a Grid
    Engine job (with ``SGE_ROOT``)."""
    from clusterkit.backends.jobqueue.sge import SGEQueue

    queue = SGEQueue()
    assert queue.parse_start(QSTAT_J_XML) == 1795759825.0
    in_ms = QSTAT_J_XML.replace(">1795759825<", ">1795759825250<")
    assert queue.parse_start(in_ms) == 1795759825.25
    pending = re.sub(r"<JB_ja_tasks>.*</JB_ja_tasks>", "", QSTAT_J_XML, flags=re.DOTALL)
    assert queue.parse_start(pending) is None
    assert queue.parse_start("error: failed receiving gdi request") is None
    assert queue.start_command("130") == ["qstat", "-j", "130", "-xml"]
    assert queue.job_here({"JOB_ID": "130", "SGE_ROOT": "/var/lib/gridengine"}) == "130"
    assert queue.job_here({"JOB_ID": "130"}) is None


def test_site_dask_config_fills_sge_fields_and_explain_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dask

    from clusterkit.profiles import load_located
    from clusterkit.siteconfig import explain

    path = tmp_path / "site.yaml"
    path.write_text("backend: sge\nworkers: 1\n")
    site = {"jobqueue.sge.queue": "long.q", "jobqueue.sge.project": "p42"}
    with dask.config.set(site):
        rows = {row[0]: row for row in explain(*load_located(str(path)))}
    assert rows["queue"][1:] == ("long.q", "Dask config jobqueue.sge.queue")
    assert rows["account"][1:] == ("p42", "Dask config jobqueue.sge.project")
    assert rows["workers"][2] == f"{path}:2"


def test_siteconfig_is_a_leaf() -> None:
    """profiles calls siteconfig; siteconfig imports nothing of clusterkit's back at run time."""
    import ast

    import clusterkit.siteconfig

    tree = ast.parse(Path(clusterkit.siteconfig.__file__).read_text())
    guarded = {id(n) for n in ast.walk(tree) if isinstance(n, ast.If) for n in ast.walk(n)}
    imports = [
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and id(node) not in guarded
    ]
    assert not [name for name in imports if name.startswith("clusterkit")], imports


def test_bundled_sge_gpu_profile_renders() -> None:
    script = api.render("sge-gpu")
    assert "#$ -N ck-sge-gpu-<id>" in script and "#$ -l gpu=2" in script
    assert "#$ -pe smp 16" in script and "#$ -l h_vmem=8192M" in script
    assert "~" not in script.split("\n#$ -cwd")[0], "log paths must be expanded"


# ---------------------------------------------------------------- on the cell


def test_contract_sge(sge: G.SGE, tmp_path: Path) -> None:
    """The contract body, under mutual TLS, and on the way: job names, status rows, job logs."""
    path = profile_file(tmp_path, "contract", prologue=["echo prologue ran in $JOB_ID >&2"])

    def jobs_named_listed_and_logged(client: Any) -> None:
        (name,) = [r.name for r in state.records() if r.backend == "sge"]
        record = state.read_record(name)
        assert record is not None and record.address.startswith("tls://127.0.0.1:")
        job_name = record.extra["job_name"]
        assert job_name.startswith("ck-contract-")
        queued = sge.queue()
        assert len(queued) == 2 and all(line.endswith(job_name) for line in queued), queued
        rows = [r for r in api.status(name)["rows"] if r["kind"] == "job"]
        assert sorted(r["name"] for r in rows) == sorted(q.split()[0] for q in queued)
        assert {r["state"] for r in rows} == {"r"}, rows
        seen = client.run(lambda: os.environ.get("JOB_ID"))
        assert sorted(seen.values()) == sorted(r["name"] for r in rows)
        job = rows[0]["name"]
        text = "\n".join(api.logs(name, component=f"job {job}")[f"job {job}"])
        assert f"prologue ran in {job}" in text and "worker" in text.lower(), text
        with pytest.raises(BadInput, match="its jobs in the queue"):
            api.logs(name, component="job 999999")

    started = time.monotonic()
    run_contract(path, scale_to=2, workloads=(runners, jobs_named_listed_and_logged))
    print(f"sge contract: {time.monotonic() - started:.1f}s")
    assert sge.queue() == [], "down left jobs in the queue"


def test_rejected_job_gives_qsub_stderr(sge: G.SGE, tmp_path: Path) -> None:
    with pytest.raises(ClusterStartError) as caught:
        api.up(profile_file(tmp_path, "badq", queue="no-such.q"))
    assert "no-such.q" in caught.value.message, caught.value.message
    assert caught.value.component == "sge job submission"
    assert sge.queue() == []


def test_pending_reason_in_status(sge: G.SGE, tmp_path: Path) -> None:
    profile = model(tmp_path, "nowhere", job_extra=["-l arch=nowhere"])
    cluster: Any = SGE.create(profile, ClusterSecurity(), name=profile.name)
    try:
        deadline = time.monotonic() + 20
        while True:  # the scheduler's reason comes with its next run (1 s here)
            (row,) = SGE.describe(cluster, profile)
            if row.extra["reason"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert row.state == "qw" and "arch" in row.extra["reason"], row
    finally:
        cluster.close()
    assert getattr(cluster, "jobs_left", []) == [] and sge.queue() == []


def test_killed_supervisor_leaves_jobs_named_for_the_cluster_that_down_cancels(
    sge: G.SGE, tmp_path: Path
) -> None:
    import psutil

    record = api.up(profile_file(tmp_path, "orphan-jobs", workers=1))
    job_name = record.extra["job_name"]
    assert job_name.startswith("ck-orphan-jobs-") and record.pid
    os.kill(record.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(record.pid)], timeout=10)
    queued = sge.queue()
    assert queued and all(line.endswith(job_name) for line in queued), queued
    api.down(record.name)
    assert sge.queue() == [], "down left the dead cluster's jobs in the queue"
    assert state.load_record(record.name) is None


def test_doctor_checks_queue_resources_and_pe(sge: G.SGE, tmp_path: Path) -> None:
    profile = model(
        tmp_path, "doc", memory_resource="h_vmem", worker={"gpus": 1}, gpu_resource="gpu_card"
    )
    checks = {c.name: c.ok for c in SGE.doctor(profile, ClusterSecurity())}
    assert checks["qsub on PATH"] and checks["sge queue 'all.q'"]
    assert checks["sge resource 'h_vmem'"] and not checks["sge resource 'gpu_card'"]
    bad = model(tmp_path, "doc2", queue="nope.q", cores=2, parallel_environment="nope")
    checks = {c.name: c.ok for c in SGE.doctor(bad, ClusterSecurity())}
    assert not checks["sge queue 'nope.q'"] and not checks["sge parallel environment 'nope'"]
    good = model(tmp_path, "doc3", cores=2, parallel_environment=G.PE, worker={"gpus": 1})
    checks = {c.name: c.ok for c in SGE.doctor(good, ClusterSecurity())}
    assert checks[f"sge parallel environment '{G.PE}'"] and checks["sge resource 'gpu'"]


def test_qsub_verifies_the_rendered_script(sge: G.SGE, tmp_path: Path) -> None:
    """`qsub -w v` checks every directive against the cell without submitting the job; the
    cell's exec host offers 4 of the consumable `gpu` (no device behind it)."""
    script = tmp_path / "job.sh"
    cases: list[tuple[str, dict[str, Any], bool]] = [
        ("cpu", {"memory_resource": "h_vmem"}, True),
        ("gpu", {"worker": {"gpus": 1}, "processes": 2, "cores": 2}, True),
        ("gpus-8", {"worker": {"gpus": 1}, "processes": 8, "cores": 8}, False),
        ("gpu-unknown", {"worker": {"gpus": 1}, "gpu_resource": "gpu_card"}, False),
    ]
    for name, fields, accepted in cases:
        profile = model(tmp_path, name, parallel_environment=G.PE, **fields)
        script.write_text(SGE.render(profile, ClusterSecurity()))
        done = sge.run("qsub", "-w", "v", str(script))
        said = done.stdout + done.stderr
        assert ("verification: found suitable queue(s)" in said) is accepted, (name, said)
    assert sge.queue() == []
