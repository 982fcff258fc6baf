"""`clusterkit up` of a slurm profile vs a raw dask-jobqueue SLURMCluster of the same shape.

One run against a private single-node SLURM on 127.0.0.1 (started as tests/slurm.py does; needs
root and scripts/setup/20-slurm.sh), repetitions interleaved with the order alternated
(bench/_side_by_side.py). Each side is timed until the workers joined:
- clusterkit up (CLI): `clusterkit up PROFILE.yaml` in a fresh process, until it returns
  (the supervisor forked from it submitted the jobs and saw the workers join);
  `clusterkit down` afterwards;
- raw SLURMCluster, fresh python: the same shape (`clusterkit profiles render` of the profile:
  1 worker per job, 1 core, 1 GiB, loopback, dashboard on a free loopback port) as a script in
  a new interpreter, until it prints; the target's baseline (<= 1.1);
- raw SLURMCluster, in-process: in this process (no interpreter start, no imports): reference;
- backend only: the slurm backend's ``create`` in this process (no CLI, supervisor or record).
After each side the queue must be empty and no job process left.

    .venv/bin/python bench/slurm_up.py [--reps 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _side_by_side as B

from tests import slurm as S

NAME = "bench-slurm"


def shape(logs: str) -> dict:
    """SLURMCluster keywords matching the profile below (its rendered job script)."""
    return {
        "queue": S.PARTITION,
        "cores": 1,
        "processes": 1,
        "memory": "1GiB",
        "walltime": "00:10:00",
        "log_directory": logs,
        "python": sys.executable,
        "death_timeout": 60,
        "worker_extra_args": ["--host", "127.0.0.1"],
        "scheduler_options": {
            "host": "127.0.0.1",
            "port": 0,
            "dashboard_address": "127.0.0.1:0",
        },
    }


def profile_yaml(logs: str, workers: int) -> str:
    return json.dumps(  # JSON is YAML
        {
            "backend": "slurm",
            "queue": S.PARTITION,
            "workers": workers,
            "processes": 1,
            "cores": 1,
            "memory": "1GiB",
            "walltime": "00:10:00",
            "log_directory": logs,
            "python": sys.executable,
            "start_timeout": "120s",
        },
        indent=1,
    )


RAW_FRESH = (
    """
import sys, json
from dask_jobqueue import SLURMCluster
N_WORKERS = int(sys.argv[2])
cluster = SLURMCluster(**json.loads(sys.argv[1]))
cluster.scale(N_WORKERS)
"""
    + B.WAIT_AND_HOLD
)


def raw_inprocess(kwargs: dict, workers: int) -> float:
    from dask_jobqueue import SLURMCluster

    started = time.perf_counter()
    cluster = SLURMCluster(**kwargs)
    try:
        cluster.scale(workers)
        B.wait_workers(cluster, workers)
        return time.perf_counter() - started
    finally:
        cluster.close()


def up_cli(path: str, env: dict[str, str]) -> float:
    try:
        return B.run_cli("up", path, "--name", NAME, env=env)
    finally:
        B.run_cli("down", NAME, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    absent = S.missing()
    if absent:
        sys.exit(f"cannot run: SLURM is not installed (missing {absent})")
    with tempfile.TemporaryDirectory() as scratch:
        slurm = S.start(Path(scratch) / "slurm")  # before the token: daemons are no leftovers
        os.environ.update(slurm.env())
        env = B.bench_env(CLUSTERKIT_STATE_DIR=f"{scratch}/state")
        logs = f"{scratch}/joblogs"
        path = Path(scratch) / "slurm-bench.yaml"
        path.write_text(profile_yaml(logs, args.workers))
        kwargs = shape(logs)

        def queue_empty(_label: str) -> list[str]:
            return [f"job left in the queue: {job}" for job in slurm.empty_queue()]

        try:
            print(f"slurm up until {args.workers} workers joined; load {B.load()}", flush=True)
            times = B.interleave(
                [
                    B.Side("clusterkit up (CLI)", lambda: up_cli(str(path), env)),
                    B.Side(
                        "raw SLURMCluster, fresh python",
                        lambda: B.run_fresh(
                            RAW_FRESH, json.dumps(kwargs), str(args.workers), env=env
                        ),
                    ),
                    B.Side(
                        "raw SLURMCluster, in-process", lambda: raw_inprocess(kwargs, args.workers)
                    ),
                    B.Side(
                        "backend only, in-process",
                        lambda: B.backend_only(str(path), args.workers),
                    ),
                ],
                args.reps,
                check=queue_empty,
            )
        finally:
            slurm.stop()
    B.table(
        times,
        "clusterkit up (CLI)",
        "raw SLURMCluster, fresh python",
        1.1,
        {
            "raw SLURMCluster, in-process": "no interpreter start or imports: reference only",
            "backend only, in-process": "clusterkit's slurm backend create, no CLI/supervisor",
        },
    )


if __name__ == "__main__":
    main()
