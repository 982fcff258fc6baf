"""Run many seeded chaos cases (tests/test_chaos.py) per backend and report each: what was
killed, when, the outcome and how long the case took, then a tally per backend.

    .venv/bin/python bench/chaos.py [--kills 50] [--seed 7] [--backends local ssh slurm kubernetes]
    .venv/bin/python bench/chaos.py --report-only ...   # tabulate a run that was stopped

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
LOG_LINE = re.compile(r"test_chaos_(\w+)\[case(\d+)\] (PASSED|FAILED|ERROR|SKIPPED)")


def run_backend(backend: str, kills: int, seed: int, keep: Path) -> None:
    """Run one backend's cases under pytest, its log and report in ``keep``."""
    counts = {f"CLUSTERKIT_CHAOS{tier}_KILLS": str(kills) for tier in ("", "_SGE", "_K8S")}
    env = {**os.environ, **counts, "CLUSTERKIT_CHAOS_SEED": str(seed)}
    report = keep / f"chaos-{backend}.xml"
    report.unlink(missing_ok=True)
    command = ["-m", "pytest", "-p", "no:cacheprovider", "-v", "-rf", "tests/test_chaos.py"]
    command += ["-k", f"test_chaos_{backend}", f"--junitxml={report}"]
    with open(keep / f"chaos-{backend}.log", "w") as log:
        subprocess.run(
            [sys.executable, *command], cwd=ROOT, env=env, check=False, stdout=log, stderr=log
        )


def read_outcomes(backend: str, keep: Path) -> dict[int, tuple[str, float]]:
    """The outcome and seconds of each case of a run: from pytest's report or, for a run that
    was stopped, the cases its log shows finished."""
    report = keep / f"chaos-{backend}.xml"
    if not report.exists():
        log = (keep / f"chaos-{backend}.log").read_text()
        named = {"PASSED": "ok", "SKIPPED": "skipped"}
        return {int(m[2]): (named.get(m[3], "FAILED"), 0.0) for m in LOG_LINE.finditer(log)}
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
    parser.add_argument(
        "--report-only", action="store_true", help="tabulate the reports in --keep (a stopped run)"
    )
    args = parser.parse_args()
    from tests.test_chaos import cases

    args.keep.mkdir(parents=True, exist_ok=True)
    summary = []
    for backend in args.backends:
        if not args.report_only:
            run_backend(backend, args.kills, args.seed, args.keep)
        outcomes = read_outcomes(backend, args.keep)
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
