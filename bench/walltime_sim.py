"""Walltime-aware placement at a site's scale (issue 41): a seeded simulation, naive vs aware.

A site: ``--workers`` GPU workers (64), each in a batch job of ``--job-hours`` (4 h) whose
lifetime ends it; the jobs at the start were submitted at staggered times (worker i's began
i/64 of a job's length before the search), and each job that ends is replaced at once by a
fresh one on the same slot (as ``adapt`` or clusterkit's replacement of ended jobs does; no
queue wait). ``--trials`` trials (1,000) with lognormal durations, mean ``--trial-hours`` (1 h),
sigma ``--sigma`` (0.5), drawn once from ``--seed``: every side runs the very same trials. A
trial still running when its job ends is killed and run again from its start (no checkpoint);
killed 1 + 2 times (``max_retries``), it fails.

- **naive**: a free worker takes the next trial (Dask with no placement: any free worker);
- **aware**: the library's own policy decides, :func:`clusterkit.runners.hpo.walltime.place`
  with :func:`~clusterkit.runners.hpo.walltime.likely_duration` (p90 of the finished trials,
  the ``--hint`` until 3 finished): a trial starts only on workers it fits; idle workers with
  too little left retire, their job ends early and a fresh one replaces it;
- **aware + checkpoint**: the same, with trials that outlive their worker
  (:mod:`clusterkit.runners.hpo.preemption`): ``--lead`` (60 s) before its job's end a running
  trial saves and stops (``should_checkpoint()``, ``TrialInterrupted``) and resumes on the next
  free worker with what was left; the lead's seconds count as idle, nothing is lost. Each
  resume counts as one of ``max_retries``, as in the library.

Accounting, in slot-hours (GPU-hours): **held** is each job's time from the search's start (or
the job's, if later) to its end (walltime, retirement, or the search's end, when every job is
cancelled); **finished** is the run time of trials that finished; **lost** the part of killed
trials that ran; **idle** the rest. Target: lost <= 2 % of held with placement.

    .venv/bin/python bench/walltime_sim.py --seed 0
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from clusterkit.runners.hpo.walltime import QUANTILE, likely_duration, place

HOUR = 3600.0
#: Re-runs of a killed trial before it fails (``hpo.run``'s ``max_retries`` default).
MAX_RETRIES = 2
JOB_END, TRIAL_END = 0, 1  # events at the same instant: a job's end first (kills its trial)


@dataclass
class Site:
    """One simulated search: slots, their jobs' ends, trials pending and running, the sums."""

    job_seconds: float
    durations: list[float]
    aware: bool
    hint: float | None
    quantile: float = QUANTILE
    lead: float | None = None  # checkpoints: seconds before a job's end a trial saves and stops
    now: float = 0.0
    ends: dict[int, float] = field(default_factory=dict)  # slot -> its job's end
    starts: dict[int, float] = field(default_factory=dict)  # slot -> its job's start (>= 0)
    running: dict[int, tuple[int, float, int]] = field(default_factory=dict)  # trial, start, run
    pending: deque[int] = field(default_factory=deque)
    finished: list[float] = field(default_factory=list)
    events: list[tuple[float, int, int, int]] = field(default_factory=list)  # when, kind, id, slot
    held = lost = 0.0
    tries: dict[int, int] = field(default_factory=dict)
    done: dict[int, float] = field(default_factory=dict)  # trial -> seconds saved by checkpoints
    kills = retired = runs = failed = resumes = 0

    def start_job(self, slot: int, began: float) -> None:
        """A job on ``slot`` that began at ``began`` (before the search: staggered)."""
        self.ends[slot] = began + self.job_seconds
        self.starts[slot] = max(began, self.now)
        heapq.heappush(self.events, (self.ends[slot], JOB_END, 0, slot))

    def end_job(self, slot: int) -> None:
        """The job on ``slot`` ends now (walltime or retirement); a fresh one replaces it."""
        self.held += self.now - self.starts[slot]
        if slot in self.running:  # the walltime kills its trial: run again from its start
            trial, started, _ = self.running.pop(slot)
            saved = self.lead is not None and self.now - self.lead > started
            if saved:  # it saved at the lead and stopped: resumes with what is left
                self.done[trial] = self.done.get(trial, 0.0) + self.now - self.lead - started
                self.resumes += 1
            else:
                self.lost += self.now - started
                self.kills += 1
            self.tries[trial] = self.tries.get(trial, 1) + 1
            if self.tries[trial] <= 1 + MAX_RETRIES:
                self.pending.appendleft(trial)
            else:  # failed for good, as the loop's max_retries does
                self.failed += 1
        self.start_job(slot, self.now)

    def dispatch(self) -> None:
        """Start pending trials on free workers, as the policy allows."""
        while self.pending:
            free = [s for s in self.ends if s not in self.running]
            allowed = free
            if self.aware:
                need = likely_duration(self.finished, self.hint, self.quantile)
                left = {str(s): end - self.now for s, end in self.ends.items()}
                busy = {str(s) for s in self.running}
                placement = place(left, busy, need)
                if placement.retire:
                    for slot in placement.retire:
                        self.retired += 1
                        self.end_job(int(slot))
                    continue  # fresh workers replaced them: decide again
                if placement.workers is not None:
                    allowed = [s for s in free if str(s) in placement.workers]
            if not allowed:
                return
            slot, trial = allowed[0], self.pending.popleft()
            self.runs += 1
            self.running[slot] = (trial, self.now, self.runs)
            done = self.now + self.durations[trial] - self.done.get(trial, 0.0)
            heapq.heappush(self.events, (done, TRIAL_END, self.runs, slot))

    def run(self, workers: int) -> float:
        """The search to its last trial; its makespan in seconds."""
        for slot in range(workers):
            self.start_job(slot, -self.job_seconds * slot / workers)
        self.pending.extend(range(len(self.durations)))
        self.dispatch()
        while len(self.finished) + self.failed < len(self.durations):
            when, kind, run, slot = heapq.heappop(self.events)
            self.now = when
            if kind == JOB_END:
                if self.ends[slot] == when:  # not a retired job's old end
                    self.end_job(slot)
            elif slot in self.running and self.running[slot][2] == run:  # not a killed run's
                trial, started, _ = self.running.pop(slot)
                self.finished.append(self.now - started + self.done.get(trial, 0.0))
            self.dispatch()
        for slot in self.ends:  # the search is over: every job is cancelled
            self.held += self.now - self.starts[slot]
        return self.now


def row(name: str, site: Site, makespan: float) -> str:
    held, finished, lost = site.held, sum(site.finished), site.lost
    idle = held - finished - lost
    cells = [f"{held / HOUR:8.0f}"]
    cells += [f"{v / HOUR:8.0f} ({100 * v / held:4.1f} %)" for v in (finished, lost, idle)]
    cells += [f"{site.kills:6d}", f"{site.resumes:7d}", f"{site.failed:6d}", f"{site.retired:8d}"]
    cells += [f"{makespan / HOUR:8.1f}"]
    return f"{name:<8}" + "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--job-hours", type=float, default=4.0)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--trial-hours", type=float, default=1.0, help="mean trial duration")
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma")
    parser.add_argument("--hint", type=float, default=None, help="trial_walltime hint, hours")
    parser.add_argument("--quantile", type=float, default=QUANTILE, help="of finished trials")
    parser.add_argument("--lead", type=float, default=60.0, help="checkpoint lead, seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    mu = math.log(args.trial_hours * HOUR) - args.sigma**2 / 2  # mean trial_hours
    durations = [rng.lognormvariate(mu, args.sigma) for _ in range(args.trials)]
    hint = None if args.hint is None else args.hint * HOUR
    print(
        f"{args.workers} workers in {args.job_hours:g} h jobs (staggered), {args.trials} trials "
        f"lognormal mean {args.trial_hours:g} h sigma {args.sigma:g}, seed {args.seed}; "
        f"slot-hours (share of held)"
    )
    header = ["held", "finished", "lost (walltime)", "idle", "kills", "resumes", "failed"]
    header += ["retired", "makespan"]
    widths = [8, 17, 17, 17, 6, 7, 6, 8, 8]
    print(f"{'':<8}" + "  ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    sides = (("naive", False, None), ("aware", True, None), ("+ckpt", True, args.lead))
    for name, aware, lead in sides:
        site = Site(args.job_hours * HOUR, durations, aware, hint, args.quantile, lead)
        print(row(name, site, site.run(args.workers)))


if __name__ == "__main__":
    main()
