"""Gang placement for multi-rank trials: which waiting trials start now, on which slots.

Every slot of a trial is reserved at once, so no two trials ever hold parts of each other's
slots. :class:`GangPolicy` (the loop's policy) starts the largest waiting trials first and fills
every slot it can with smaller ones, with no slot held idle for a guess. A trial that
``patience`` later trials have overtaken becomes the head of the line: from then on a trial
behind it starts only when that does not delay it by the estimates (EASY backfilling, as
:func:`plan` does for the in-order policy): it is expected to end before the head can start, or
it uses slots the head will not need then. No start may make a waiting trial overtaken more than
``2 * patience`` times, so no trial, of any size, waits behind more than ``2 * patience`` later
ones (see :func:`pick`). Estimates are the median durations of finished trials of each size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import BadInput
from clusterkit.runners.ddp.placement import Slot

PLACEMENTS = ("pack", "spread")

#: Later trials that may start ahead of a waiting one before it gets a reservation; twice as
#: many is the most that ever do.
PATIENCE = 8

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
    """A trial in line: its number, how many slots it needs, and how many trials that came
    after it in line have started while it waited."""

    number: int
    size: int
    overtaken: int = 0


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


def pick(
    waiting: Sequence[Waiting],
    free: Sequence[Slot],
    running: Sequence[Running],
    estimate: Callable[[int], float | None],
    now: float,
    placement: str = "pack",
    patience: int = PATIENCE,
) -> list[tuple[int, list[Slot]]]:
    """The trials to start now (``waiting`` in line order, oldest first) and their slots.

    While no trial is due (overtaken ``patience`` times), the largest trial that fits starts,
    then the next. The oldest due trial is the head: it starts when it fits, else only trials
    that do not delay it by the estimates are backfilled (:func:`plan`). No start makes a trial
    ahead of it in line overtaken more than ``2 * patience`` times.
    """
    free, running = list(free), list(running)
    position = {item.number: i for i, item in enumerate(waiting)}
    count = {item.number: item.overtaken for item in waiting}
    sizes = {item.number: item.size for item in waiting}
    starts: list[tuple[int, list[Slot]]] = []

    def allowed(number: int) -> bool:
        return all(count[n] < 2 * patience for n in count if position[n] < position[number])

    def take(number: int, slots: list[Slot]) -> None:
        starts.append((number, slots))
        free[:] = [s for s in free if s not in slots]
        seconds = estimate(sizes[number])
        running.append(Running(sizes[number], None if seconds is None else now + seconds))
        del count[number]
        for other in count:
            count[other] += position[other] < position[number]

    while count:
        due = [n for n in sorted(count, key=position.__getitem__) if count[n] >= patience]
        line = sorted(count, key=lambda n: (-sizes[n], position[n]))
        if due:
            line = [due[0]] + [n for n in line if n != due[0]]
            if (slots := choose(free, sizes[due[0]], placement)) is not None:
                take(due[0], slots)
                continue
            backfill = plan(
                [Waiting(n, sizes[n]) for n in line], free, running, estimate, now, placement
            )
            for number, slots in backfill:  # a start past the cap is left for later
                if allowed(number) and set(slots) <= set(free):
                    take(number, slots)
            return starts
        fitting = [(n, s) for n in line if (s := choose(free, sizes[n], placement)) is not None]
        fitting = [(n, s) for n, s in fitting if allowed(n)]
        if not fitting:
            return starts
        take(*fitting[0])
    return starts


@dataclass
class GangPolicy:
    """The gang loop's placement policy, with what it learns as the search goes: each size's
    durations (for estimates) and how often each waiting trial has been overtaken."""

    patience: int = PATIENCE
    durations: dict[int, list[float]] = field(default_factory=dict)
    overtaken: dict[int, int] = field(default_factory=dict)

    def finished(self, size: int, seconds: float) -> None:
        """A gang of ``size`` ranks held its slots for ``seconds``."""
        self.durations.setdefault(size, []).append(seconds)

    def estimate(self, size: int) -> float | None:
        """The median duration of finished gangs of ``size``; None while none finished."""
        seen = sorted(self.durations.get(size, ()))
        return seen[len(seen) // 2] if seen else None

    def shortest(self, line: Sequence[tuple[int, int]]) -> float | None:
        """The likely seconds of the shortest gang of ``line`` ((number, size)): the least
        estimate of the sizes waiting; None while none of them finished."""
        seconds = [self.estimate(size) for size in {size for _, size in line}]
        return min((s for s in seconds if s is not None), default=None)

    def first(self, number: int) -> None:
        """Trial ``number`` (a retry) is due: it heads the line until it starts."""
        self.overtaken[number] = max(self.overtaken.get(number, 0), self.patience)

    def head(self, line: Sequence[tuple[int, int]]) -> int | None:
        """The size of the trial of ``line`` that starts first when slots free: the oldest due
        one, else the largest (the oldest of them); None for an empty line."""
        due = [size for n, size in line if self.overtaken.get(n, 0) >= self.patience]
        return due[0] if due else max((size for _, size in line), default=None)

    def gang(self, size: int, started: float, now: float) -> Running:
        """A running gang of ``size`` started at ``started``, with its expected end."""
        seconds = self.estimate(size)
        return Running(size, None if seconds is None else max(now, started + seconds))

    def place(
        self,
        line: Sequence[tuple[int, int]],
        free: Sequence[Slot],
        running: Sequence[Running],
        now: float,
        placement: str = "pack",
    ) -> list[tuple[int, list[Slot]]]:
        """The trials of ``line`` ((number, size), oldest first) to start now, and their slots;
        the trials left waiting count every later trial that started."""
        waiting = [Waiting(n, size, self.overtaken.get(n, 0)) for n, size in line]
        starts = pick(waiting, free, running, self.estimate, now, placement, self.patience)
        begun = {number for number, _ in starts}
        order = {item.number: i for i, item in enumerate(waiting)}
        self.overtaken = {
            item.number: item.overtaken + sum(order[n] > order[item.number] for n in begun)
            for item in waiting
            if item.number not in begun
        }
        return starts


class InOrderPolicy(GangPolicy):
    """The policy before :class:`GangPolicy`, kept to compare with: trials start in line order,
    a later one only when it does not delay the head by the estimates (:func:`plan`)."""

    def place(
        self,
        line: Sequence[tuple[int, int]],
        free: Sequence[Slot],
        running: Sequence[Running],
        now: float,
        placement: str = "pack",
    ) -> list[tuple[int, list[Slot]]]:
        waiting = [Waiting(n, size) for n, size in line]
        return plan(waiting, free, running, self.estimate, now, placement)
