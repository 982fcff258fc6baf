"""Run many seeded chaos cases (tests/test_chaos.py) and report each: what was killed, when, the
outcome and how long the case took.

    .venv/bin/python bench/chaos.py [--kills 50] [--seed 7]

Every case SIGKILLs the supervisor, a worker or the driver during `up`, `scale` or a search on
the local backend, then checks that `down` leaves nothing and the study holds each trial once.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    from tests.test_chaos import cases

    env = {**os.environ, "CLUSTERKIT_CHAOS_KILLS": str(args.kills),
           "CLUSTERKIT_CHAOS_SEED": str(args.seed)}
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "chaos.xml"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
             "tests/test_chaos.py", f"--junitxml={report}"],
            cwd=ROOT, env=env, check=False,
        )
        outcomes = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            index = int(case.get("name", "").split("case")[-1].rstrip("]"))
            failed = case.find("failure") is not None or case.find("error") is not None
            outcomes[index] = ("FAILED" if failed else "ok", float(case.get("time", 0)))
    tally: collections.Counter[tuple[str, str, str]] = collections.Counter()
    print(f"{'case':>5}  {'what':44} {'outcome':8} {'s':>6}")
    for index, case in enumerate(cases(args.seed, args.kills)):
        outcome, seconds = outcomes.get(index, ("missing", 0.0))
        tally[(case.phase, case.victim, outcome)] += 1
        print(f"{index:>5}  {case!s:44} {outcome:8} {seconds:6.1f}")
    print("\nby phase and victim:")
    for (phase, victim, outcome), count in sorted(tally.items()):
        print(f"  {phase:6} {victim:10} {outcome:8} {count}")


if __name__ == "__main__":
    main()
