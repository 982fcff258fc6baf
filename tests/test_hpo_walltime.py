"""Walltime-aware placement (:mod:`clusterkit.runners.hpo.walltime`): the pure policy, and a
search on workers of different lifetimes that avoids the one ending first, then retires it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import inputs
from clusterkit.runners.hpo.walltime import (
    MIN_FINISHED,
    Placement,
    completed_durations,
    likely_duration,
    place,
    seconds_left,
)


@pytest.mark.unit
def test_the_likely_duration_is_the_hint_until_enough_trials_finished() -> None:
    assert likely_duration([], None) is None
    assert likely_duration([10.0] * (MIN_FINISHED - 1), 30.0) == 30.0
    durations = [float(s) for s in range(1, 11)]  # 1..10 s
    assert likely_duration(durations, 30.0) == pytest.approx(9.1)  # numpy's p90
    assert likely_duration(durations, None, quantile=0.5) == pytest.approx(5.5)


@pytest.mark.unit
def test_a_worker_ending_before_the_trial_is_avoided() -> None:
    left = {"a": 100.0, "b": 20.0, "k8s": None}
    assert place(left, busy=set(), need=30.0) == Placement(("a", "k8s"), retire=("b",))
    # busy: its running trial counts one more likely duration
    assert place(left, busy={"a"}, need=30.0) == Placement(("a", "k8s"), retire=("b",))
    assert place(left, busy={"a"}, need=60.0) == Placement(("k8s",), retire=("b",))


@pytest.mark.unit
def test_a_busy_short_worker_is_not_retired_and_no_constraint_without_ends() -> None:
    assert place({"a": 100.0, "b": 20.0}, busy={"b"}, need=30.0) == Placement(("a",))
    assert place({"a": None, "b": None}, busy=set(), need=30.0) == Placement(None)
    assert place({"a": 100.0, "b": 20.0}, busy=set(), need=None) == Placement(None)


@pytest.mark.unit
def test_when_no_worker_fits_the_trial_goes_to_the_longest_and_idle_ones_retire() -> None:
    placement = place({"a": 10.0, "b": 20.0, "c": 25.0}, busy={"c"}, need=30.0)
    assert placement == Placement(("c",), retire=("a", "b"))


@pytest.mark.unit
def test_seconds_left_and_completed_durations() -> None:
    assert seconds_left({"a": 150.0, "b": None}, now=100.0) == {"a": 50.0, "b": None}
    start = datetime(2026, 1, 1)
    trials = [
        SimpleNamespace(
            state=optuna.trial.TrialState.COMPLETE,
            datetime_start=start,
            datetime_complete=start + timedelta(seconds=42),
        ),
        SimpleNamespace(
            state=optuna.trial.TrialState.PRUNED,
            datetime_start=start,
            datetime_complete=start + timedelta(seconds=5),
        ),
    ]
    assert completed_durations(trials) == [42.0]


@pytest.mark.unit
def test_a_resumed_trial_counts_its_whole_run_in_the_likely_duration() -> None:
    """A trial that resumed from a checkpoint took its attempts' run in all, not its last one's:
    the p90 that places trials is not lowered by short resumed attempts."""
    from clusterkit.runners.hpo.dispatch import WalltimeGuard

    guard = WalltimeGuard(None, SimpleNamespace(get_trials=lambda deepcopy: []), 30.0)  # type: ignore[arg-type]
    for _ in range(MIN_FINISHED):
        record = {"state": "COMPLETE", "start": 100.0, "end": 105.0}
        guard.finished(record, before=35.0)  # 35 s till it saved, 5 s after the resume
    assert guard.need == pytest.approx(40.0)


# ------------------------------------------------------------------ a real LocalCluster

SHORT_LIFETIME = "12s"
TRIAL_SECONDS = 3.0


@pytest.fixture
def two_lifetimes() -> Iterator[tuple[object, str]]:
    """A client on two one-thread workers: "short", ending SHORT_LIFETIME after its start, and
    "long", with no end; and the short one's address."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "host": "127.0.0.1"}}
    short = {"host": "127.0.0.1", "nthreads": 1, "lifetime": SHORT_LIFETIME, "lifetime_stagger": 0}
    workers = {
        "short": {"cls": Nanny, "options": short},
        "long": {"cls": Nanny, "options": {"host": "127.0.0.1", "nthreads": 1}},
    }
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        info = client.scheduler_info(n_workers=-1)["workers"]
        address = next(a for a, w in info.items() if w["name"] == "short")
        yield client, address


def three_second_objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(TRIAL_SECONDS)
    return x * x


@pytest.mark.local
def test_placement_avoids_the_worker_ending_first_and_retires_it(
    two_lifetimes: tuple[object, str], caplog: pytest.LogCaptureFixture
) -> None:
    client, short = two_lifetimes
    trials, retired = _search_and_retired(client, caplog, 10, TRIAL_SECONDS)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 10
    on_short = [t.number for t in trials if t.user_attrs[inputs.ATTR_WORKER] == short]
    assert on_short, "the short-lived worker took trials while they fit"
    # no trial was cut by the short worker's lifetime and run again elsewhere
    again = {
        t.number: t.user_attrs[inputs.ATTR_ATTEMPTS]
        for t in trials
        if inputs.ATTR_ATTEMPTS in t.user_attrs
    }
    assert again == {}
    assert len(retired) == 1 and short in retired[0], retired


def _search_and_retired(
    client: object, caplog: pytest.LogCaptureFixture, n_trials: int, hint: float, **gangs: Any
) -> tuple[list[Any], list[str]]:
    """The trials of a search of :func:`three_second_objective` with that ``trial_walltime``
    hint, and its ``retiring`` log lines."""
    with caplog.at_level(logging.INFO, logger="clusterkit.runners.hpo"):
        study = hpo.run(
            three_second_objective,
            n_trials=n_trials,
            client=client,  # type: ignore[arg-type]
            storage=optuna.storages.InMemoryStorage(),
            progress=False,
            trial_walltime=hint,
            **gangs,
        )
    retired = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retiring")]
    return study.get_trials(deepcopy=False), retired


def one_rank(params: dict[str, object]) -> int:
    return 1


@pytest.mark.local
def test_a_gang_search_retires_an_idle_worker_too_short_for_any_gang(
    two_lifetimes: tuple[object, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Gang trials (sized by a function: the gang loop, one rank each here) start only on slots
    with their likely duration left, and an idle worker with less left than the shortest gang
    waiting is retired, as the one-rank search does: with a hint longer than the short worker's
    whole lifetime, it is retired before any trial and every trial runs on the other."""
    client, short = two_lifetimes
    hint = 2 * float(SHORT_LIFETIME.rstrip("s"))
    trials, retired = _search_and_retired(client, caplog, 3, hint, ranks_per_trial=one_rank)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert all(short not in t.user_attrs[inputs.ATTR_GANG] for t in trials)
    assert len(retired) == 1 and short in retired[0], retired


@pytest.mark.local
def test_a_trial_placed_on_workers_that_all_left_goes_to_a_fresh_one() -> None:
    """A task placed (loosely) on a worker that left while no other ran waits in ``no-worker``,
    and Dask does not hand it to a fresh worker its restrictions do not name; free_stranded
    (the search runs it when workers join) does."""
    from distributed import Client, LocalCluster

    from clusterkit.runners.hpo.dispatch import free_stranded

    options = {"n_workers": 1, "threads_per_worker": 1, "processes": False}
    with LocalCluster(dashboard_address=":0", **options) as cluster, Client(cluster) as client:
        (gone,) = client.scheduler_info(n_workers=-1)["workers"]
        cluster.scale(0)
        deadline = time.monotonic() + 30
        while client.scheduler_info(n_workers=-1)["workers"] and time.monotonic() < deadline:
            time.sleep(0.05)
        future = client.submit(abs, -2, workers=[gone], allow_other_workers=True, pure=False)
        cluster.scale(1)
        client.wait_for_workers(1, timeout=30)
        time.sleep(1.0)
        assert future.status == "pending"  # Dask's gap: stranded, the fresh worker idle
        assert client.run_on_scheduler(free_stranded) == [str(future.key)]
        assert future.result(timeout=30) == 2
