"""The gang runner's placement policies replayed with zero overhead (an event simulation).

It separates what a policy costs from what launching costs: the measured makespan over this
one is launch and hand-off overhead. Two policies: ``largest first`` (the loop's
:class:`~clusterkit.runners.hpo.gangs.GangPolicy`: the largest waiting trials first, every slot
filled, a reservation for a trial overtaken too often) and ``in order`` (the policy before it:
trials start in order, a smaller one jumps the line only when that does not delay the head,
:func:`~clusterkit.runners.hpo.gangs.plan`); durations are estimated from finished trials of
each size in both.
"""

from __future__ import annotations

from typing import Any

POLICIES = ("largest first", "in order")


def zero_overhead_makespan(
    trials: list[tuple[int, float]], slots: int, lookahead: int, policy: str = POLICIES[0]
) -> float:
    """Makespan of ``trials`` ((k, t) in order) on ``slots`` slots of one host under
    ``policy``, every launch and hand-off instant."""
    from clusterkit.runners.ddp.placement import Slot
    from clusterkit.runners.hpo import gangs

    layout = [Slot(f"w{i}", "host", 0, False, 1) for i in range(slots)]
    rule = gangs.InOrderPolicy() if policy == "in order" else gangs.GangPolicy()
    running: list[tuple[float, float, int, list[Any]]] = []  # (end, start, k, slots)
    line: list[int] = []
    following, now = 0, 0.0
    while True:
        started = True
        while started:  # as the loop does: refill the line and place until nothing starts
            while len(line) < lookahead and following < len(trials):
                line.append(following)
                following += 1
            held = {slot for *_, gang in running for slot in gang}
            free = [slot for slot in layout if slot not in held]
            gangs_now = [rule.gang(k, start, now) for _, start, k, _ in running]
            chosen = rule.place([(n, trials[n][0]) for n in line], free, gangs_now, now)
            for number, gang in chosen:
                line.remove(number)
                size, seconds = trials[number]
                running.append((now + seconds, now, size, gang))
            started = bool(chosen)
        if not running:
            return now
        running.sort(key=lambda gang: gang[0])
        now, start, size, _ = running.pop(0)
        rule.finished(size, now - start)
