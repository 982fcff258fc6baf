"""Walltime-aware placement, the pure policy: which workers may start a trial, which retire.

A worker with an end (a batch job's lifetime: its walltime less the profile's margin) takes a
trial only if it has time left for the trial's likely duration (a quantile of the finished
trials' durations; until there are enough, the user's hint; else no constraint). A worker
running a trial is counted as busy for one more likely duration. An idle worker with too little
left for any trial is retired, so its job ends and its hours stop being charged (``adapt``, or
the backend's replacement of ended jobs, brings a fresh one). The search's loop and
``bench/walltime_sim.py`` both decide with :func:`place`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The quantile of finished trials' durations a trial is assumed to need.
QUANTILE = 0.9
#: Finished trials needed before their durations replace the user's hint.
MIN_FINISHED = 3


def likely_duration(
    durations: Iterable[float], hint: float | None, quantile: float = QUANTILE
) -> float | None:
    """Seconds a trial likely takes: the ``quantile`` of ``durations`` (finished trials) once
    there are MIN_FINISHED; before, ``hint`` (the user's ``trial_walltime``; None: none)."""
    ordered = sorted(durations)
    if len(ordered) < MIN_FINISHED:
        return hint
    position = quantile * (len(ordered) - 1)  # linear interpolation, numpy's default
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Placement:
    """Where the next trial may start (None: on any worker) and the workers to retire now."""

    workers: tuple[str, ...] | None
    retire: tuple[str, ...] = ()


def place(left: Mapping[str, float | None], busy: Collection[str], need: float | None) -> Placement:
    """The placement of the next trial. ``left``: seconds each live worker has left (None: it
    has no end); ``busy``: the workers running a trial; ``need``: the trial's likely duration
    (None: unknown, no constraint).

    A worker fits when it has no end, or ``need`` left after its running trial (counted as
    ``need`` more). The trial is restricted to the workers that fit; idle workers with less
    than ``need`` left are retired (fresh jobs replace them). When none fits, the trial goes to
    the worker with the most time left (the quantile is pessimistic: it may finish)."""
    if need is None or all(seconds is None for seconds in left.values()):
        return Placement(None)
    fits = []
    for worker, seconds in left.items():
        wait = need if worker in busy else 0.0
        if seconds is None or seconds - wait >= need:
            fits.append(worker)
    retire = [w for w, s in left.items() if s is not None and s < need and w not in busy]
    if not fits:
        fits = [max(left, key=lambda w: left[w] or 0.0)]
    return Placement(tuple(sorted(fits)), tuple(sorted(retire)))


def seconds_left(ends: Mapping[str, float | None], now: float) -> dict[str, float | None]:
    """``ends`` (each worker's end, a time.time() stamp, or None) as seconds left at ``now``."""
    return {w: None if end is None else end - now for w, end in ends.items()}


def completed_durations(trials: Iterable[Any]) -> list[float]:
    """Seconds each completed trial (Optuna's FrozenTrial) ran, from its start to its end."""
    return [
        (t.datetime_complete - t.datetime_start).total_seconds()
        for t in trials
        if t.state.name == "COMPLETE" and t.datetime_start and t.datetime_complete
    ]
