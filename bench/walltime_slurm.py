"""Walltime-aware placement on a real SLURM (issue 41): the same search, placement off and on.

A private single-node SLURM on 127.0.0.1 (tests/slurm.py; needs root and
scripts/setup/20-slurm.sh; its node declared with ``CPUS`` cores so the sides fit at once). Each
side is one search in a process of its own, all sides at the same time (the same machine load):
``--workers`` (3) SLURM jobs of ``--walltime`` (120 s), whose workers' lifetime ends them at the
walltime less the profile's default margin (90 s, staggered +-15 s; dask-jobqueue's
``--lifetime``), each ended job replaced by a fresh one (a fixed-size cluster replaces ended
jobs). ``--trials`` (24) trials, each sleeping its own duration (``t``, uniform over
[``--shortest``, ``--longest``] = [10, 40] s, seeded, the same trials enqueued on every side) in
half-second steps; ``trial_walltime`` (the user's hint) is ``--longest``; ``max_retries`` 5.

- **naive**: walltime placement off: the bench switches the loop's placement
  (:class:`clusterkit.runners.hpo.dispatch.WalltimeGuard`) to none, as bench/gangs.py switches
  gang policies: any free worker takes the next trial, no worker retires early; a trial still
  running at its worker's end is killed and runs again from its start (what stays: a worker
  within its checkpoint lead, the last ~9 s, holds a trial handed to it till Dask moves it);
- **aware**: the library as it is (:mod:`clusterkit.runners.hpo.walltime`): a trial starts only
  on workers it fits (the hint, then the p90 of finished trials), idle workers with too little
  left retire, their jobs end early and fresh ones replace them;
- **aware + ckpt**: the same, with an objective that asks ``hpo.should_checkpoint()`` between
  steps, saves its progress in ``hpo.checkpoint_dir(trial)`` and raises ``hpo.TrialInterrupted``;
  the trial resumes on another worker from what it saved.

Figures are the search's own account (``account.json``, :mod:`clusterkit.runners.hpo.account`):
core-seconds held from each job's start (``squeue %S``), split into finished, lost (attempts
whose worker ended under them: here only walltime kills; the hours redone) and idle. An attempt
that saved a checkpoint counts toward its trial's outcome, not as lost (its work was kept);
``saved``: the seconds of progress such attempts kept (the objective's own log). ``killed``:
trials with an attempt lost; ``interrupted``: trials that saved and stopped; ``resumed``:
trials that started again from a checkpoint (the objective's log). The simulation at a site's
scale (bench/walltime_sim.py, seed 0) is printed beside.

    .venv/bin/python bench/walltime_slurm.py [--workers 3 --trials 24 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIDES = ("naive", "aware", "aware + ckpt")
#: bench/walltime_sim.py --seed 0 (64 workers in 4-hour jobs, 1,000 one-hour trials): lost % held
SIM_LOST = {"naive": 14.2, "aware": 4.1, "aware + ckpt": 0.0}
#: cores the bench's SLURM node declares (every side's jobs at once, replacements overlapping)
CPUS = 24
STEP = 0.5


def durations(n: int, shortest: float, longest: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [round(rng.uniform(shortest, longest), 1) for _ in range(n)]


def objective(trial: Any) -> float:
    """Sleep ``t`` seconds in steps; with a checkpoint folder, save and stop when asked."""
    from clusterkit.runners import hpo

    t = trial.suggest_float("t", 0.0, 1e6)
    folder = hpo.checkpoint_dir(trial) if CHECKPOINTS else None
    done = float((folder / "done").read_text()) if folder and (folder / "done").exists() else 0.0
    if folder is not None and done > 0:
        with open(folder / "resumed", "a") as log:
            log.write(f"{done}\n")
    began = done
    while done < t:
        if folder is not None and hpo.should_checkpoint():
            (folder / "done").write_text(str(done))
            with open(folder / "saved", "a") as log:
                log.write(f"{done - began}\n")  # this attempt's progress, kept
            raise hpo.TrialInterrupted()
        step = min(STEP, t - done)
        time.sleep(step)
        done += step
    return t


CHECKPOINTS = False  # set in the side's process before the search


def placement_off() -> None:
    """Walltime placement off: no restriction of where a trial starts, no early retirement."""
    from clusterkit.runners.hpo import dispatch

    dispatch.WalltimeGuard.restrictions = lambda self, inflight: {}  # type: ignore[method-assign]
    dispatch.WalltimeGuard.bounded = property(lambda self: False)  # type: ignore[method-assign]


def profile(folder: Path, workers: int, walltime: int) -> Path:
    from tests import slurm as S

    path = folder / "profile.yaml"
    data = {
        "backend": "slurm",
        "queue": S.PARTITION,
        "workers": workers,
        "cores": 1,
        "memory": "512MiB",
        "walltime": f"00:{walltime // 60:02d}:{walltime % 60:02d}",
        "log_directory": str(folder / "joblogs"),
        "python": sys.executable,
        "start_timeout": "180s",
        "scheduler": {"dashboard": False},
    }
    path.write_text(json.dumps(data, indent=1))  # JSON is YAML
    return path


def side(args: argparse.Namespace) -> None:
    """One side, in this process: up, the search, down; its figures to ``args.json``."""
    global CHECKPOINTS
    import optuna

    from clusterkit import api
    from clusterkit.client import get_client
    from clusterkit.runners import hpo

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder = Path(args.folder)
    CHECKPOINTS = args.side == "aware + ckpt"
    if args.side == "naive":
        placement_off()
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    for t in durations(args.trials, args.shortest, args.longest, args.seed):
        study.enqueue_trial({"t": t})
    name = "wt-" + args.side.replace(" + ", "-")
    record = api.up(profile(folder, args.workers, args.walltime), name=name)
    started = time.monotonic()
    try:
        with get_client(record.name) as client:
            hpo.run(
                objective,
                n_trials=args.trials,
                client=client,
                study=study,
                progress=False,
                out=str(folder / "out"),
                workdir=None,
                trial_walltime=args.longest,
                max_retries=5,
                timeout=args.timeout,
                checkpoint_dir=str(folder / "ckpt") if CHECKPOINTS else None,
            )
    finally:
        wall = time.monotonic() - started
        api.down(record.name)
    account = json.loads((folder / "out" / "account.json").read_text())
    states = [t.state.name for t in study.trials]
    ckpt = folder / "ckpt"
    resumed = sorted(ckpt.glob("trial-*/resumed")) if CHECKPOINTS else []
    saved = [float(x) for p in ckpt.glob("trial-*/saved") for x in p.read_text().split()]
    result = {
        "side": args.side,
        "wall": wall,
        "account": {
            k: account[k] for k in ("held", "finished", "pruned", "failed", "lost", "idle")
        },
        "jobs": len(account["workers"]),  # one worker per job
        "workers": account["workers"],
        "killed": sum(1 for t in account["trials"].values() if t.get("lost", 0) > 0.5),
        "interrupted": len(list(ckpt.glob("trial-*/saved"))),
        "finished": states.count("COMPLETE"),
        "failed": states.count("FAIL"),
        "resumed": len(resumed),
        "saved": sum(saved),
    }
    Path(args.json).write_text(json.dumps(result))


def row(result: dict[str, Any]) -> str:
    a = result["account"]
    return (
        f"| {result['side']} | {a['held']:.0f} | {a['finished']:.0f} | {a['lost']:.0f} "
        f"| {a['lost'] / a['held']:.1%} | {a['idle'] / a['held']:.0%} | {result['killed']} "
        f"| {result['interrupted']} | {result['resumed']} | {result['saved']:.0f} "
        f"| {result['finished']}/{result['finished'] + result['failed']} "
        f"| {result['jobs']} | {result['wall']:.0f} | {SIM_LOST[result['side']]:.1f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--shortest", type=float, default=10.0)
    parser.add_argument("--longest", type=float, default=40.0)
    parser.add_argument("--walltime", type=int, default=120, help="seconds")
    parser.add_argument("--timeout", type=float, default=420.0, help="no trial starts after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="write every side's figures (JSON) to this file")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a side's process
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args)
        return
    from tests import slurm as S

    absent = S.missing()
    if absent:
        sys.exit(f"cannot run: SLURM is not installed (missing {absent})")
    S.CPUS, S.REAL_MEMORY_MB = CPUS, CPUS * 1024  # sleep trials: room for every side's jobs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM)"))  # clean up first
    with tempfile.TemporaryDirectory() as scratch:
        slurm = S.start(Path(scratch) / "slurm")
        env = {**os.environ, **slurm.env(), "CLUSTERKIT_STATE_DIR": f"{scratch}/state"}
        begun, load = time.monotonic(), os.getloadavg()
        children = []
        try:
            for name in SIDES:
                folder = Path(scratch) / name.replace(" + ", "-")
                folder.mkdir()
                command = [sys.executable, __file__, *sys.argv[1:], "--side", name]
                command += ["--folder", str(folder), "--json", str(folder / "result.json")]
                log = open(folder / "side.log", "w")  # noqa: SIM115 - closed below
                child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
                children.append((name, folder, log, child))
            deadline = time.monotonic() + args.timeout + 240  # the last trials, up and down
            for name, folder, log, child in children:
                child.wait(timeout=max(1.0, deadline - time.monotonic()))
                log.close()
                if child.returncode != 0:
                    print(f"side {name} failed:\n{(folder / 'side.log').read_text()[-3000:]}")
        finally:
            for _, _, _, child in children:
                if child.poll() is None:  # its search stops and takes its cluster down
                    child.terminate()
                    try:
                        child.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait()
            left = slurm.empty_queue()
            slurm.stop()
        results = [
            json.loads((folder / "result.json").read_text())
            for _, folder, _, _ in children
            if (folder / "result.json").exists()
        ]
    if args.keep:
        Path(args.keep).write_text(json.dumps(results, indent=1))
    end_load = os.getloadavg()
    print(
        f"{args.workers} SLURM jobs per side, walltime {args.walltime}s (worker lifetime "
        f"{args.walltime - 30}s +-15s), {args.trials} trials of U({args.shortest:.0f}, "
        f"{args.longest:.0f}) s, seed {args.seed}; the {len(SIDES)} sides at once, "
        f"{time.monotonic() - begun:.0f}s in all; load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} at the start, {end_load[0]:.2f} {end_load[1]:.2f} {end_load[2]:.2f} "
        f"at the end ({os.cpu_count()} cores)"
    )
    print(
        "| side | held core-s | finished | lost | lost % | idle % | killed | interrupted "
        "| resumed | saved s | trials finished | jobs | search s | sim lost % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        print(row(result))
    if left:
        print(f"jobs left in the queue after the run: {left}")


if __name__ == "__main__":
    main()
