"""Run many seeded chaos cases (tests/test_chaos.py) per backend and report each: what was
killed, when, the outcome and how long the case took, then a tally per backend.

    .venv/bin/python bench/chaos.py [--kills 50] [--seed 7] [--backends local ssh slurm kubernetes]

Every case SIGKILLs a supervisor, scheduler, worker, connection or driver during `up`, `scale`
or a search, then checks that `down` leaves nothing (processes, remote folders, jobs, pods) and
that the study holds each trial once. Failures keep pytest's report in --keep.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BACKENDS = ("local", "ssh", "slurm", "kubernetes")
NAME = re.compile(r"test_chaos_(\w+)\[case(\d+)\]")


def run_backend(backend: str, kills: int, seed: int, keep: Path) -> dict[int, tuple[str, float]]:
    """Run one backend's cases under pytest; the outcome and seconds of each case."""
    env = {**os.environ, "CLUSTERKIT_CHAOS_KILLS": str(kills), "CLUSTERKIT_CHAOS_SEED": str(seed)}
    report = keep / f"chaos-{backend}.xml"
    with open(keep / f"chaos-{backend}.log", "w") as log:
        subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf",
             "tests/test_chaos.py", "-k", f"test_chaos_{backend}", f"--junitxml={report}"],
            cwd=ROOT, env=env, check=False, stdout=log, stderr=subprocess.STDOUT,
        )
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        match = NAME.fullmatch(case.get("name", ""))
        if not match:
            continue
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        outcome = "FAILED" if failed else "skipped" if skipped else "ok"
        outcomes[int(match.group(2))] = (outcome, float(case.get("time", 0)))
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--keep", type=Path, default=Path("chaos-reports"))
    args = parser.parse_args()
    from tests.test_chaos import cases

    args.keep.mkdir(parents=True, exist_ok=True)
    summary = []
    for backend in args.backends:
        outcomes = run_backend(backend, args.kills, args.seed, args.keep)
        tally: collections.Counter[tuple[str, str, str]] = collections.Counter()
        print(f"\n== {backend} (seed {args.seed}) ==")
        print(f"{'case':>5}  {'what':44} {'outcome':8} {'s':>6}")
        for index, case in enumerate(cases(args.seed, args.kills, backend)):
            outcome, seconds = outcomes.get(index, ("missing", 0.0))
            tally[(case.phase, case.victim, outcome)] += 1
            print(f"{index:>5}  {case!s:44} {outcome:8} {seconds:6.1f}", flush=True)
        print("by phase and victim:")
        for (phase, victim, outcome), count in sorted(tally.items()):
            print(f"  {phase:6} {victim:10} {outcome:8} {count}")
        ok = sum(1 for outcome, _ in outcomes.values() if outcome == "ok")
        total_s = sum(seconds for _, seconds in outcomes.values())
        summary.append((backend, len(outcomes), ok, total_s))
    print("\nbackend      cases  clean  failed  minutes")
    for backend, count, ok, total_s in summary:
        print(f"{backend:12} {count:5}  {ok:5}  {count - ok:6}  {total_s / 60:7.1f}")


if __name__ == "__main__":
    main()
