"""The account of the hours for gang searches (``ranks_per_trial``): each launch of a gang holds
its k slots, on one worker or several, from its launch until its last rank ended (the driver's
clock). Its slot-seconds split as a one-rank trial's do (:mod:`.account`): finished, pruned or
failed by the trial's state; lost when a worker of the gang died (each slot until its worker
left or the driver saw the gang end); a launch interrupted with a checkpoint (its worker
ending, :mod:`.gang_preemption`) counts toward the trial's outcome once the trial ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from clusterkit.runners.hpo.account import BY_STATE, Ledger, Segment


def held_by(slots: Sequence[Any], unit: str) -> list[tuple[str, float]]:
    """What a gang on ``slots`` (:class:`~clusterkit.runners.ddp.placement.Slot`) holds, per
    rank: its worker and slots (a GPU; on a CPU worker the cores its rank runs on)."""
    return [(slot.worker, 1.0 if unit == "GPU" else float(slot.threads)) for slot in slots]


class GangLedger(Ledger):
    """A :class:`~.account.Ledger` whose trials are gangs: :meth:`launched` opens an attempt
    holding several slots; :meth:`ended` and :meth:`lost` close it."""

    def __init__(self, resources: Mapping[str, float] | None, since: float | None = None) -> None:
        super().__init__(resources, since)
        self.gangs: dict[int, list[tuple[str, float]]] = {}  # trial -> (worker, slots) per rank

    def launched(self, trial: int, held: list[tuple[str, float]], stamp: float | None) -> None:
        """A launch of ``trial`` holding ``held`` (:func:`held_by`) from ``stamp`` (now)."""
        stamp = time.time() if stamp is None else stamp
        if trial in self.running:
            self.lost(trial, stamp)
        self.gangs[trial] = held
        self.running[trial] = (held[0][0], stamp)
        for worker, _ in held:
            self.joined.setdefault(worker, max(self.since, stamp))

    def _close(self, trial: int, end: float, outcome: str) -> list[Segment]:
        """The open launch of ``trial`` as segments ending at ``end`` (or their worker's leave)."""
        opened, held = self.running.pop(trial, None), self.gangs.pop(trial, [])
        if opened is None:
            return []
        start = opened[1]
        return [
            Segment(w, trial, start, max(start, min(end, self.left.get(w, math.inf))), n, outcome)
            for w, n in held
        ]

    def ended(self, trial: int, record: Mapping[str, Any]) -> float:
        """The trial ended in ``record["state"]`` (now): its open launch and the launches
        interrupted with a checkpoint count so; the seconds those ran (one per launch)."""
        outcome = BY_STATE.get(record["state"], "failed")
        kept = self.kept.pop(trial, [])
        self.segments += [s._replace(outcome=outcome) for s in kept]
        self.segments += self._close(trial, time.time(), outcome)
        return sum(end - start for start, end in {(s.start, s.end) for s in kept})

    def lost(self, trial: int, stamp: float | None = None, cause: object = None) -> None:
        """The open launch of ``trial`` ended unfinished (now, or ``stamp``): lost, or kept for
        the trial's outcome where it saved a checkpoint (``cause`` a TrialInterrupted)."""
        from clusterkit.runners.hpo.preemption import TrialInterrupted

        end = time.time() if stamp is None else stamp
        closed = self._close(trial, end, "lost")
        if isinstance(cause, TrialInterrupted):
            self.kept.setdefault(trial, []).extend(closed)
        else:
            self.segments += closed
