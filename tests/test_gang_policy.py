"""The gang loop's placement policy (:class:`clusterkit.runners.hpo.gangs.GangPolicy`) as pure
logic: the largest waiting trials first with every slot filled, a reservation for a trial that
later ones overtook too often, and a cap on how often any trial is overtaken."""

from __future__ import annotations

import pytest

from clusterkit.runners.ddp.placement import Slot
from clusterkit.runners.hpo import gangs

pytestmark = pytest.mark.unit


def _slots(count: int, host: str = "a") -> list[Slot]:
    return [Slot(f"tcp://{host}:{i}", host, 0, False, 1) for i in range(count)]


def _numbers(starts: list[tuple[int, list[Slot]]]) -> list[int]:
    return [number for number, _ in starts]


def test_the_largest_trials_start_first_and_smaller_ones_fill_the_slots_left() -> None:
    line = [(1, 2), (2, 4), (3, 1)]  # oldest first
    free = _slots(5)
    # in order: trial 1 starts, trial 2 (4 slots) does not fit the 3 left and nothing is known
    # of durations, so nothing jumps it: 2 slots idle
    assert _numbers(gangs.InOrderPolicy().place(line, free, [], now=0.0)) == [1]
    assert _numbers(gangs.GangPolicy().place(line, free, [], now=0.0)) == [2, 3]


def test_waiting_trials_count_the_later_trials_that_started_before_them() -> None:
    policy = gangs.GangPolicy()
    policy.place([(1, 4), (2, 1), (3, 1)], _slots(1), [], now=0.0)
    assert policy.overtaken == {1: 1, 3: 0}  # trial 2 started; it came after 1, not after 3


def test_a_trial_overtaken_patience_times_gets_a_reservation() -> None:
    free = _slots(1)
    running = [gangs.Running(1, end=10.0 + i) for i in range(7)]  # 4 slots free at t=13
    waiting_long = lambda size: 50.0  # noqa: E731 - a 1-rank trial would end at t=50
    fresh = [gangs.Waiting(1, 4, overtaken=0), gangs.Waiting(2, 1)]
    assert _numbers(gangs.pick(fresh, free, running, waiting_long, now=0.0, patience=3)) == [2]
    due = [gangs.Waiting(1, 4, overtaken=3), gangs.Waiting(2, 1)]
    assert gangs.pick(due, free, running, waiting_long, now=0.0, patience=3) == []
    # a trial that ends before the head can start still fills the gap (EASY backfilling)
    short = lambda size: 5.0  # noqa: E731
    assert _numbers(gangs.pick(due, free, running, short, now=0.0, patience=3)) == [2]


def test_no_trial_is_overtaken_more_than_twice_patience_times() -> None:
    free = _slots(1)
    running = [gangs.Running(1, end=10.0 + i) for i in range(7)]
    short = lambda size: 5.0  # noqa: E731 - backfilling would not delay the head
    capped = [gangs.Waiting(1, 4, overtaken=6), gangs.Waiting(2, 1), gangs.Waiting(3, 1)]
    assert gangs.pick(capped, free, running, short, now=0.0, patience=3) == []
    # an older trial than the capped one may still start
    older = [gangs.Waiting(0, 1), *capped]
    assert _numbers(gangs.pick(older, free, running, short, now=0.0, patience=3)) == [0]


def test_a_retried_trial_heads_the_line() -> None:
    line = [(5, 1), (6, 4)]
    assert _numbers(gangs.GangPolicy().place(line, _slots(4), [], now=0.0)) == [6]
    policy = gangs.GangPolicy()
    assert policy.head(line) == 4  # the live line's "next in line: k=4"
    policy.first(5)
    assert policy.head(line) == 1
    assert _numbers(policy.place(line, _slots(4), [], now=0.0)) == [5]
    assert policy.head([]) is None


def test_a_large_gang_starts_under_a_stream_of_one_rank_trials() -> None:
    """8 slots, one 4-rank trial in line behind a never-ending stream of 1-rank trials that end
    one at a time: without a reservation it would never find 4 free slots."""
    patience, slots = 4, _slots(8)
    policy = gangs.GangPolicy(patience=patience)
    running: list[tuple[float, int, float, list[Slot]]] = []  # (end, number, start, slots)
    line, following, now, started_before = [(0, 4)], 1, 0.0, 0
    for number in range(1, 8):  # 7 one-rank trials hold 7 slots, ending 1 s apart
        running.append((1.0 + number, number, 0.0, [slots[number]]))
    while all(number != 0 for _, number, _, _ in running):
        assert now < 1000.0, "the 4-rank trial never started"
        while len(line) < 8:  # the search keeps sampling 1-rank trials
            line.append((following, 1))
            following += 1
        held = {slot for *_, gang in running for slot in gang}
        free = [slot for slot in slots if slot not in held]
        gangs_now = [policy.gang(1, start, now) for _, _, start, _ in running]
        for number, gang in policy.place(line, free, gangs_now, now):
            line.remove((number, dict(line)[number]))
            started_before += number != 0
            running.append((now + 8.0, number, now, gang))
        assert all(count <= 2 * patience for count in policy.overtaken.values())
        running.sort()
        now, _, start, _ = running.pop(0)
        policy.finished(1, now - start)
    assert started_before <= 2 * patience


def test_estimates_are_the_median_duration_of_each_size() -> None:
    policy = gangs.GangPolicy()
    assert policy.gang(2, started=0.0, now=1.0) == gangs.Running(2, None)
    for seconds in (3.0, 1.0, 2.0):
        policy.finished(2, seconds)
    assert policy.estimate(2) == 2.0 and policy.estimate(4) is None
    assert policy.gang(2, started=0.0, now=1.0) == gangs.Running(2, 2.0)
    assert policy.gang(2, started=0.0, now=5.0) == gangs.Running(2, 5.0)  # overdue: ends now
