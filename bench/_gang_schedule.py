"""The gang runner's own placement policy replayed with zero overhead (an event simulation).

It separates what the policy costs (trials start in order; a smaller one jumps the line only
when that does not delay the head, with durations estimated from finished trials of its size)
from what launching costs: the measured makespan over this one is launch and hand-off overhead.
"""

from __future__ import annotations

from typing import Any


def zero_overhead_makespan(trials: list[tuple[int, float]], slots: int, lookahead: int) -> float:
    """Makespan of ``trials`` ((k, t) in order) on ``slots`` slots of one host under
    :func:`clusterkit.runners.hpo.gangs.plan`, every launch and hand-off instant."""
    from clusterkit.runners.ddp.placement import Slot
    from clusterkit.runners.hpo import gangs

    layout = [Slot(f"w{i}", "host", 0, False, 1) for i in range(slots)]
    durations: dict[int, list[float]] = {}
    running: list[tuple[float, float, int, list[Any]]] = []  # (end, start, k, slots)
    line: list[int] = []
    following, now = 0, 0.0

    def estimate(size: int) -> float | None:
        seen = sorted(durations.get(size, ()))
        return seen[len(seen) // 2] if seen else None

    while True:
        started = True
        while started:  # as the loop does: refill the line and place until nothing starts
            while len(line) < lookahead and following < len(trials):
                line.append(following)
                following += 1
            held = {slot for *_, gang in running for slot in gang}
            free = [slot for slot in layout if slot not in held]
            gangs_now = [
                gangs.Running(k, _end(estimate(k), start, now)) for _, start, k, _ in running
            ]
            waiting = [gangs.Waiting(n, trials[n][0]) for n in line]
            chosen = gangs.plan(waiting, free, gangs_now, estimate, now)
            for number, gang in chosen:
                line.remove(number)
                size, seconds = trials[number]
                running.append((now + seconds, now, size, gang))
            started = bool(chosen)
        if not running:
            return now
        running.sort(key=lambda gang: gang[0])
        now, start, size, _ = running.pop(0)
        durations.setdefault(size, []).append(now - start)


def _end(seconds: float | None, start: float, now: float) -> float | None:
    return None if seconds is None else max(now, start + seconds)
