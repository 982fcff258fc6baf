"""`clusterkit up` of a slurm profile vs a raw dask-jobqueue SLURMCluster of the same shape.

One run against a private single-node SLURM on 127.0.0.1 (started as in the tests; needs root
and scripts/setup/20-slurm.sh), repetitions interleaved with the order alternated. Each side is
timed from the call to "all workers connected": the clusterkit side is `api.up` (detached
supervisor, job submission, readiness, record), the baseline `SLURMCluster(...)` +
`scale(n)` + `client.wait_for_workers(n)`; a third column times the backend's `create_cluster`
in-process, to split backend and lifecycle (supervisor process) cost; a fourth runs the
baseline as a script in a new interpreter, which pays Python start and `import distributed`
as `up`'s supervisor does. Prints per-repetition times, medians and the ratios (target <= 1.1).

    .venv/bin/python bench/slurm_up.py [--reps 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import slurm as S

SHAPE = {"cores": 1, "memory": "1GiB", "walltime": "00:10:00", "queue": S.PARTITION}


def raw(workers: int, logs: str) -> float:
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    started = time.perf_counter()
    cluster = SLURMCluster(
        processes=1,
        log_directory=logs,
        python=sys.executable,
        scheduler_options={"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
        **SHAPE,
    )
    cluster.scale(workers)
    with Client(cluster) as client:
        client.wait_for_workers(workers)
        elapsed = time.perf_counter() - started
    cluster.close()
    return elapsed


RAW_SCRIPT = """
import sys
from dask_jobqueue import SLURMCluster
from distributed import Client

cluster = SLURMCluster(
    processes=1, log_directory=sys.argv[2], python=sys.executable,
    scheduler_options={"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
    **SHAPE,
)
cluster.scale(int(sys.argv[1]))
with Client(cluster) as client:
    client.wait_for_workers(int(sys.argv[1]))
    print("ready", flush=True)
    sys.stdin.readline()  # the timer stopped; now close
cluster.close()
"""


def raw_fresh(workers: int, logs: str) -> float:
    """The baseline as a script in a new interpreter: it pays imports, as the supervisor does."""
    import subprocess

    script = f"SHAPE = {SHAPE!r}\n{RAW_SCRIPT}"
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(workers), logs],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    elapsed = time.perf_counter() - started
    child.stdin.write("\n")
    child.stdin.close()
    child.wait(timeout=60)
    return elapsed


def clusterkit_up(workers: int, logs: str) -> float:
    from clusterkit import api
    from clusterkit.schema import SLURMProfile

    name = f"bench-slurm-{uuid.uuid4().hex[:6]}"
    profile = SLURMProfile.model_validate(
        {
            "backend": "slurm",
            "workers": workers,
            "log_directory": logs,
            "start_timeout": 120,
            **SHAPE,
        }
    ).named(name)
    started = time.perf_counter()
    api.up(profile)  # returns once the workers joined
    elapsed = time.perf_counter() - started
    api.down(name)
    return elapsed


def backend_only(workers: int, logs: str) -> float:
    """The slurm backend's create_cluster in this process: its cost without the supervisor."""
    from distributed import Client

    from clusterkit.backends.jobqueue.backend import SLURMBackend

    SLURM = SLURMBackend()
    from clusterkit.schema import SLURMProfile
    from clusterkit.security import ClusterSecurity

    profile = SLURMProfile.model_validate(
        {
            "backend": "slurm",
            "workers": workers,
            "log_directory": logs,
            **SHAPE,
            "scheduler": {"dashboard": False},
        }
    ).named("bench-backend")
    started = time.perf_counter()
    cluster = SLURM.create(profile, ClusterSecurity(), name="bench")  # type: ignore[arg-type]
    with Client(cluster) as client:
        client.wait_for_workers(workers)
        elapsed = time.perf_counter() - started
    cluster.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    absent = S.missing()
    if absent:
        sys.exit(f"cannot run: SLURM is not installed (missing {absent})")
    with tempfile.TemporaryDirectory() as scratch:
        os.environ.setdefault("CLUSTERKIT_STATE_DIR", f"{scratch}/state")
        slurm = S.start(Path(scratch) / "slurm")
        os.environ.update(slurm.env())
        logs = f"{scratch}/joblogs"
        times: dict[str, list[float]] = {
            "raw SLURMCluster": [],
            "clusterkit up": [],
            "backend only": [],
            "raw, new process": [],
        }
        try:
            for rep in range(args.reps):
                order = [
                    ("raw SLURMCluster", raw),
                    ("clusterkit up", clusterkit_up),
                    ("backend only", backend_only),
                    ("raw, new process", raw_fresh),
                ]
                for label, fn in order if rep % 2 == 0 else reversed(order):
                    times[label].append(fn(args.workers, logs))
                    left = slurm.empty_queue()
                    assert not left, f"jobs left after {label}: {left}"
                print(
                    f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                    flush=True,
                )
        finally:
            slurm.stop()
    base = statistics.median(times["raw SLURMCluster"])
    ours = statistics.median(times["clusterkit up"])
    backend = statistics.median(times["backend only"])
    fresh = statistics.median(times["raw, new process"])
    ratios = [o / b for o, b in zip(times["clusterkit up"], times["raw SLURMCluster"], strict=True)]
    print(
        f"median raw SLURMCluster {base:.2f}s, clusterkit up {ours:.2f}s, "
        f"ratio {ours / base:.2f} (per-rep median {statistics.median(ratios):.2f}, "
        f"target <= 1.1), {args.workers} workers, {args.reps} reps; backend alone "
        f"{backend:.2f}s (ratio {backend / base:.2f}); raw in a new process {fresh:.2f}s "
        f"(clusterkit up / that {ours / fresh:.2f})"
    )


if __name__ == "__main__":
    main()
