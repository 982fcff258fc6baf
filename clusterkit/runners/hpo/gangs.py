"""Gang placement for multi-rank trials: which waiting trials start now, on which slots.

Every slot of a trial is reserved at once, so no two trials ever hold parts of each other's
slots. Trials start in order; a later, smaller trial fills a gap only when it does not delay the
trial at the head of the line (EASY backfilling): it is expected to end before the head can
start, or it uses slots the head will not need then. Expected ends come from the durations of
finished trials of the same size; while none are known, nothing jumps the line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clusterkit.errors import BadInput
from clusterkit.runners.ddp.placement import Slot

PLACEMENTS = ("pack", "spread")

RanksPerTrial = int | Callable[[dict[str, Any]], int]


@dataclass
class GangOptions:
    """How trials become gangs: their size (or a function of their parameters), placement,
    the project the ranks run in, and where each trial's checkpoints go (``DIR/trial-N``)."""

    ranks: RanksPerTrial
    placement: str = "pack"
    project: Any = None
    checkpoint_dir: str | None = None

    def checkpoints_of(self, number: int) -> str | None:
        """Trial ``number``'s checkpoint folder: every attempt of it resumes from there."""
        if self.checkpoint_dir is None:
            return None
        return f"{self.checkpoint_dir.rstrip('/')}/trial-{number}"


def options(
    ranks: RanksPerTrial, placement: str, checkpoint_dir: str | None = None
) -> GangOptions | None:
    """The checked gang options; None for one rank per trial (the plain path)."""
    if placement not in PLACEMENTS:
        raise BadInput(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if isinstance(ranks, int) and (ranks < 1 or isinstance(ranks, bool)):
        raise BadInput(f"ranks_per_trial must be at least 1, got {ranks!r}")
    if ranks == 1:
        return None
    if not isinstance(ranks, int) and not callable(ranks):
        raise BadInput(f"ranks_per_trial must be an int or a function, got {ranks!r}")
    return GangOptions(ranks, placement, checkpoint_dir=checkpoint_dir)


@dataclass(frozen=True)
class Waiting:
    """A trial in line: its number and how many slots it needs."""

    number: int
    size: int


@dataclass(frozen=True)
class Running:
    """A gang holding ``size`` slots until about ``end`` (monotonic seconds; None: unknown)."""

    size: int
    end: float | None


def choose(free: Sequence[Slot], size: int, placement: str = "pack") -> list[Slot] | None:
    """``size`` of the free slots, or None when too few are free.

    ``pack``: one host if any can hold the gang (the one with the fewest free slots that still
    fit), else the hosts with the most free slots first. ``spread``: one slot per host in turn,
    hosts with the most free slots first.
    """
    if len(free) < size:
        return None
    by_host: dict[str, list[Slot]] = {}
    for slot in free:
        by_host.setdefault(slot.host, []).append(slot)
    if placement == "pack":
        fitting = [host for host, slots in by_host.items() if len(slots) >= size]
        if fitting:
            return by_host[min(fitting, key=lambda host: len(by_host[host]))][:size]
    hosts = sorted(by_host.values(), key=len, reverse=True)
    chosen: list[Slot] = []
    if placement == "pack":
        for slots in hosts:
            chosen += slots[: size - len(chosen)]
        return chosen
    depth = 0
    while len(chosen) < size:
        chosen += [slots[depth] for slots in hosts if depth < len(slots)][: size - len(chosen)]
        depth += 1
    return chosen


def _shadow(need: int, free: int, running: Sequence[Running]) -> tuple[float | None, int]:
    """When the head (``need`` slots) can start at the latest, and the slots to spare then."""
    have = free
    for gang in sorted(running, key=lambda g: (g.end is None, g.end or 0.0)):
        if gang.end is None:
            return None, 0
        have += gang.size
        if have >= need:
            return gang.end, have - need
    return None, 0


def plan(
    waiting: Sequence[Waiting],
    free: Sequence[Slot],
    running: Sequence[Running],
    estimate: Callable[[int], float | None],
    now: float,
    placement: str = "pack",
) -> list[tuple[int, list[Slot]]]:
    """The trials to start now and their slots: in order while they fit, then backfill."""
    free, queue, running = list(free), list(waiting), list(running)
    starts: list[tuple[int, list[Slot]]] = []

    def take(item: Waiting, slots: list[Slot]) -> None:
        starts.append((item.number, slots))
        free[:] = [s for s in free if s not in slots]
        seconds = estimate(item.size)
        running.append(Running(item.size, None if seconds is None else now + seconds))

    while queue and (slots := choose(free, queue[0].size, placement)) is not None:
        take(queue.pop(0), slots)
    if len(queue) < 2:
        return starts
    shadow, spare = _shadow(queue[0].size, len(free), running)
    if shadow is None:
        return starts
    for item in queue[1:]:
        slots = choose(free, item.size, placement)
        if slots is None:
            continue
        seconds = estimate(item.size)
        ends_first = seconds is not None and now + seconds <= shadow
        if ends_first or item.size <= spare:
            take(item, slots)
            spare -= 0 if ends_first else item.size
    return starts
