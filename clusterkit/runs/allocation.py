"""Inside a batch run's job (:mod:`clusterkit.runs.batch`): ``python -m
clusterkit.runs.allocation RUN_ID`` on the job's first process

- starts the scheduler (certificates from the run's folder, which compute nodes share),
- starts one worker per task of the allocation (``srun`` on SLURM, ``pbsdsh`` on PBS, each
  ``python -m clusterkit.runs.allocation RUN_ID --worker``),
- runs the run's monitor, which runs the driver against that scheduler and restarts it after
  a death by signal, as for ``--detach``,
- and ends the workers and the scheduler once the driver has ended, so the job ends; a job
  warned of its walltime requeues itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from clusterkit import state
from clusterkit.errors import ClusterkitError
from clusterkit.runs.batch import SCHEDULER_FILE, TLS_DIR, job_id
from clusterkit.runs.records import REQUEUE_NAME, STOP_NAME, RunRecord, get

#: Seconds the job's first process waits for its scheduler, then for its workers.
SCHEDULER_TIMEOUT = 60.0


def _environment(record: RunRecord) -> dict[str, str]:
    """The cluster's environment inside the job: the profile's, and TLS with the run's files."""
    from clusterkit.security import server_tls_env

    batch = record.batch or {}
    env = {**os.environ, **batch["env"]}
    if (state.run_dir(record.id) / TLS_DIR).is_dir():
        env.update(server_tls_env(str(state.run_dir(record.id) / TLS_DIR)))
    return env


def worker(run_id: str) -> int:
    """One task of the allocation: a Dask worker (a dask-cuda one with GPUs) that joins the
    run's scheduler once its file exists, and ends with the job."""
    record = get(run_id)
    batch = record.batch or {}
    scheduler_file = state.run_dir(run_id) / SCHEDULER_FILE
    deadline = time.monotonic() + SCHEDULER_TIMEOUT
    while not scheduler_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    command = [batch["python"], "-m", batch["worker_module"], *batch["worker"]]
    os.execve(command[0], command, _environment(record))


def _launch_workers(record: RunRecord, log: Any, env: dict[str, str]) -> list[subprocess.Popen]:
    """One worker per task: one ``srun`` step (SLURM), one ``pbsdsh -n I`` each (PBS)."""
    batch = record.batch or {}
    task = [batch["python"], "-m", "clusterkit.runs.allocation", record.id, "--worker"]
    kwargs: dict[str, Any] = {"stdout": log, "stderr": log, "stdin": subprocess.DEVNULL, "env": env}
    if batch["system"] == "slurm":
        srun = ["srun", "--kill-on-bad-exit=0", f"--ntasks={batch['workers']}", *task]
        return [subprocess.Popen(srun, **kwargs)]
    return [
        subprocess.Popen(["pbsdsh", "-n", str(index), "--", *task], **kwargs)
        for index in range(batch["workers"])
    ]


def _wait_for_scheduler(process: subprocess.Popen, path: Path) -> str:
    import json

    deadline = time.monotonic() + SCHEDULER_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ClusterkitError(f"the run's scheduler exited with {process.returncode}")
        with contextlib.suppress(OSError, ValueError):
            return str(json.loads(path.read_text())["address"])
        time.sleep(0.1)
    raise ClusterkitError(f"the run's scheduler wrote no {path.name} in {SCHEDULER_TIMEOUT:g}s")


def _wait_for_workers(address: str, count: int, tls: Path) -> None:
    from distributed import Client

    from clusterkit.security import ClusterSecurity

    security = ClusterSecurity.in_directory(str(tls)).client_only().distributed()
    with Client(address, security=security, timeout=SCHEDULER_TIMEOUT) as client:
        client.wait_for_workers(count, timeout=SCHEDULER_TIMEOUT * 5)


def _end_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + 30
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _requeue(record: RunRecord) -> bool:
    """Put this job back in the queue; whether the batch system took it."""
    job = job_id(record) or ""
    system = (record.batch or {}).get("system")
    command = ["scontrol", "requeue", job] if system == "slurm" else ["qrerun", job]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    return done.returncode == 0


def _asked_to_requeue(folder: Path) -> bool:
    """Whether the job's end was the walltime's warning (SIGUSR1, from ``--signal``): the job
    requeues itself. After a SIGTERM the batch system requeues it (preemption) or not (the
    job was cancelled: the run then shows as lost)."""
    try:
        return (folder / REQUEUE_NAME).read_text().strip() == "SIGUSR1"
    except OSError:
        return False


def _watch_for_stop(record: RunRecord) -> None:
    """`runs stop` on another host writes the stop request to the shared folder: turn it
    into the SIGTERM the monitor understands."""
    path = state.run_dir(record.id) / STOP_NAME
    while not path.exists():
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def job(run_id: str) -> int:
    """The job's first process: scheduler, workers, then the monitor and its driver."""
    from clusterkit.runs.process import monitor, note

    record = get(run_id)
    if record.final:  # stopped while the batch system restarted its job
        return 0
    batch = record.batch or {}
    folder = state.run_dir(run_id)
    batch["job_id"] = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID")
    if batch["starts"]:
        record.restarts += 1
        record.reasons.append(f"job {batch['job_id']} started again by {batch['system']}")
    batch["starts"] += 1
    (folder / REQUEUE_NAME).unlink(missing_ok=True)
    record.batch, record.host, record.state = batch, state.HOST, "starting"
    record.save()
    env = _environment(record)
    (folder / SCHEDULER_FILE).unlink(missing_ok=True)
    with open(folder / "cluster.log", "ab") as log:
        scheduler = subprocess.Popen(
            [batch["python"], "-m", "distributed.cli.dask_scheduler", *batch["scheduler"]],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        processes = [scheduler]
        try:
            address = _wait_for_scheduler(scheduler, folder / SCHEDULER_FILE)
            processes += _launch_workers(record, log, env)
            _wait_for_workers(address, batch["workers"], folder / TLS_DIR)
            note(record, f"job {batch['job_id']}: scheduler {address}, {batch['workers']} workers")
            os.environ["CLUSTERKIT_SCHEDULER"] = address
            if (folder / TLS_DIR).is_dir():
                os.environ["CLUSTERKIT_SECURITY"] = str(folder / TLS_DIR)
            threading.Thread(target=_watch_for_stop, args=(record,), daemon=True).start()
            monitor(run_id, batch=True)
        except ClusterkitError as error:
            from clusterkit.runs.process import end

            end(get(run_id), "failed", 1, str(error))
        finally:
            _end_all(processes[::-1])
    record = get(run_id)
    if record.state == "queued" and _asked_to_requeue(folder):
        if _requeue(record):
            note(record, f"job {batch['job_id']} requeued: the run resumes when it starts again")
            return 0
        from clusterkit.runs.process import end

        end(record, "failed", 1, f"job {batch['job_id']} could not be requeued")
    return 0 if record.state == "succeeded" else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m clusterkit.runs.allocation RUN_ID [--worker]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in args:
        return worker(args[0])
    return job(args[0])


if __name__ == "__main__":
    sys.exit(main())
