"""Detached runs against attached ones: `clusterkit hpo --detach` vs `clusterkit hpo`.

Both sides run the 60-trial search of bench/hpo.py (lognormal trial durations, mean 0.5 s,
sigma 1.0, capped at 4 s, seeded per repetition) on the same cluster from `clusterkit up`
(W single-thread local workers), interleaved, order alternating per repetition. Measured from
the study itself (each trial's start and end, stamped on its worker):

- command to first trial: from the command's start to the first trial's start (detached: the
  command returns at once; the driver starts in the background);
- makespan: from the first trial's start to the last trial's end (the steady state).

    .venv/bin/python bench/runs.py --workers 2 --reps 3

Targets (issue 24): first trial within 1.2x of attached; makespan within 1.02x.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _side_by_side import CLUSTERKIT, LEFTOVERS, bench_env, load, reap, table
from hpo import N_TRIALS, durations

from clusterkit import runs

OBJECTIVE = """
import math
import time

TIMES = {times!r}


def objective(trial):
    x = [trial.suggest_float(f"x{{i}}", -5.0, 15.0) for i in range(4)]
    time.sleep(TIMES[trial.number % len(TIMES)])
    return sum((v - 2.5) ** 2 for v in x) / 100 + math.cos(x[0])
"""


def clusterkit(*args: str, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [CLUSTERKIT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"clusterkit {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def measured(study_name: str, started: float, folder: Path) -> tuple[float, float]:
    """(command to first trial start, first start to last end) from the trials' stamps."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from clusterkit.runners.hpo.inputs import ATTR_TIME, counted

    storage = JournalStorage(JournalFileBackend(str(folder / f"{study_name}.optuna.log")))
    trials = [t for t in optuna.load_study(study_name=study_name, storage=storage).get_trials()]
    stamps = [t.user_attrs[ATTR_TIME] for t in trials if counted(t)]
    if len(stamps) != N_TRIALS:
        raise RuntimeError(f"{study_name}: {len(stamps)} trials counted, not {N_TRIALS}")
    first, last = min(s[0] for s in stamps), max(s[1] for s in stamps)
    return first - started, last - first


def run_side(detached: bool, rep: int, env: dict[str, str], folder: Path) -> tuple[float, float]:
    name = f"{'detached' if detached else 'attached'}-{rep}"
    (folder / f"{name}.py").write_text(OBJECTIVE.format(times=durations(rep)))
    args = [
        "hpo",
        f"{name}.py:objective",
        "-n",
        str(N_TRIALS),
        "-p",
        "benchruns",
        "--study-name",
        name,
        "--out",
        f"{name}-results",
    ]
    started = time.time()
    if detached:
        run_id = clusterkit(*args, "--detach", env=env, cwd=folder).strip()
        # in this process (a polling read of the record): a `clusterkit runs wait` started
        # now would pay its interpreter start on the cores the driver starts on
        if runs.wait(run_id) != 0:
            raise RuntimeError(f"run {run_id} failed: {runs.show(run_id)['state']}")
    else:
        clusterkit(*args, "--no-progress", env=env, cwd=folder)
    return measured(name, started, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as tmp:
        folder = Path(tmp)
        os.environ["CLUSTERKIT_STATE_DIR"] = str(folder / "state")
        env = bench_env()
        token = env["CLUSTERKIT_BENCH_TOKEN"]
        profile = folder / "benchruns.yaml"
        profile.write_text(
            f"backend: local\nworkers: {options.workers}\nworker:\n  threads: 1\n"
            "scheduler:\n  dashboard: false\n"
        )
        clusterkit("up", str(profile), env=env, cwd=folder)
        first: dict[str, list[float]] = {"attached": [], "detached": []}
        makespan: dict[str, list[float]] = {"attached": [], "detached": []}
        try:
            for rep in range(options.reps):
                order = [False, True] if rep % 2 == 0 else [True, False]
                for detached in order:
                    label = "detached" if detached else "attached"
                    to_first, span = run_side(detached, rep, env, folder)
                    first[label].append(to_first)
                    makespan[label].append(span)
                print(
                    f"rep {rep} (load {load()}): "
                    + ", ".join(
                        f"{k} first {first[k][-1]:.2f}s makespan {makespan[k][-1]:.2f}s"
                        for k in first
                    ),
                    flush=True,
                )
        finally:
            clusterkit("down", "benchruns", env=env, cwd=folder)
            for pid, command in reap(token).items():
                LEFTOVERS.append(f"left running: {pid} {command}")
        print(f"\n{options.workers} single-thread local workers, {N_TRIALS} trials")
        print("command to first trial started:")
        met_first = table(first, "detached", "attached", 1.2)
        print("\nmakespan, first trial start to last trial end:")
        met_span = table(makespan, "detached", "attached", 1.02)
        os.environ.pop("CLUSTERKIT_BENCH_TOKEN", None)
        sys.exit(0 if met_first and met_span and not LEFTOVERS else 1)


if __name__ == "__main__":
    main()
