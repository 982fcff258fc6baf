"""Project directory bench: time to the first rank running with a 50 MiB, 2,000-file project.

Side by side on one LocalCluster that is already up (spare rank processes ready), repetitions
interleaved: ``ddp.run`` with no project (the baseline), with the project synced to a fresh
cache (first run), and again unchanged (rerun); and ``rsync -a`` of the same directory to a
fresh place (first) and again (unchanged). Added start-up is the run's time to the first rank
running minus the baseline's in the same repetition. Targets: rerun <= 0.2 s added; first run
<= 1.5x rsync.

    .venv/bin/python bench/workdir.py [--reps 3] [--files 2000] [--mib 50]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time


def make_project(root: str, files: int, mib: int) -> None:
    """``files`` files of random bytes totalling ``mib`` MiB, ten per folder."""
    size = mib * 2**20 // files
    for index in range(files):
        folder = os.path.join(root, f"pkg{index // 10:03d}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"mod{index}.py"), "wb") as handle:
            handle.write(os.urandom(size))


def first_rank_started(ctx) -> float:
    return time.time()


def time_to_first_rank(client, workdir) -> float:
    """Seconds from the call to the rank running; the project is scanned inside the timing,
    with no digests remembered from earlier runs (as in a fresh `clusterkit train`)."""
    from clusterkit.runners import ddp
    from clusterkit.runners.workdir import project

    ddp.wait_ready(client)  # each run starts with a warm spare rank process, as on a quiet cluster
    project._digests.clear()
    start = time.time()
    started = ddp.run(first_rank_started, client=client, world_size=1, workdir=workdir)
    return min(started) - start


def rsync(source: str, target: str) -> float:
    start = time.perf_counter()
    subprocess.run(["rsync", "-a", f"{source}/", f"{target}/"], check=True)
    return time.perf_counter() - start


def repetition(client, project: str, scratch: str, rep: int) -> dict[str, float]:
    os.environ["CLUSTERKIT_WORKDIR_COPY"] = "1"  # the synced copy, as without a shared disk
    os.environ["CLUSTERKIT_WORKDIR_CACHE"] = cache = os.path.join(scratch, f"cache{rep}")
    client.run(os.environ.__setitem__, "CLUSTERKIT_WORKDIR_CACHE", cache)
    row = {"baseline": time_to_first_rank(client, None)}
    row["first"] = time_to_first_rank(client, project)
    row["rerun"] = time_to_first_rank(client, project)
    target = os.path.join(scratch, f"rsync{rep}")
    row["rsync first"] = rsync(project, target)
    row["rsync rerun"] = rsync(project, target)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=50)
    args = parser.parse_args()
    if shutil.which("rsync") is None:
        raise SystemExit("error: rsync is not installed: apt-get install -y rsync")
    import distributed

    from clusterkit.runners import ddp

    with tempfile.TemporaryDirectory(prefix="ck-bench-workdir-") as scratch:
        project = os.path.join(scratch, "project")
        make_project(project, args.files, args.mib)
        with (
            distributed.LocalCluster(
                n_workers=1, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
            ) as cluster,
            distributed.Client(cluster) as client,
        ):
            ddp.wait_ready(client)
            time_to_first_rank(client, None)  # warm: imports, first group
            rows = [repetition(client, project, scratch, rep) for rep in range(args.reps)]
    report(rows, args)


def report(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    added_first = statistics.median(r["first"] - r["baseline"] for r in rows)
    added_rerun = statistics.median(r["rerun"] - r["baseline"] for r in rows)
    ratio = statistics.median((r["first"] - r["baseline"]) / r["rsync first"] for r in rows)
    print(f"project: {args.files} files, {args.mib} MiB; {args.reps} repetitions (medians)")
    print(f"{'side':<34}{'seconds':>10}")
    for key in ("baseline", "first", "rerun", "rsync first", "rsync rerun"):
        print(f"{key:<34}{median(key):>10.3f}")
    print(f"{'added start-up, first run':<34}{added_first:>10.3f}")
    print(f"{'added start-up, unchanged rerun':<34}{added_rerun:>10.3f}   target <= 0.2")
    print(f"{'first run added / rsync first':<34}{ratio:>10.2f}x  target <= 1.5x")


if __name__ == "__main__":
    main()
