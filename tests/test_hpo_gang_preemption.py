"""Gang trials that outlive their worker (:mod:`clusterkit.runners.hpo.gang_preemption`) and the
account of a gang search's hours (:mod:`clusterkit.runners.hpo.gang_account`).

On real clusters of one-thread workers, one of which ends at its ``lifetime`` (a batch job's
walltime less its margin): every rank of a 2-rank gang on it sees ``hpo.should_checkpoint()``
True at the same step, saves (a collective save) and raises ``hpo.TrialInterrupted``; the trial
resumes on workers with time left from that step and ends with the value of all its steps. A
torchrun-style objective that traps SIGTERM, saves and exits is resumed, not failed. A gang
search's account adds up to the slots its workers held."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import dask
import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import account, gang_preemption, inputs
from clusterkit.runners.hpo.gang_account import GangLedger
from clusterkit.runners.hpo.preemption import TrialInterrupted

optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LIFETIME = 40.0  # seconds: the short-lived worker's
LEAD = 8.0  # seconds before its end its gang checkpoints
STEPS, STEP_SECONDS = 80, 0.5  # 40 s of work a trial: longer than the short worker has left


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture
def one_short() -> Iterator[tuple[object, str]]:
    """A client on four one-thread workers: "short", ending LIFETIME s after its start, and three
    with no end (two gangs of 2 hold all four: one holds "short", and resumes on the others once
    the other gang ended); and the short one's address."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    from clusterkit.runners.ddp.driver import prepare

    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "host": "127.0.0.1"}}
    short = {"host": "127.0.0.1", "nthreads": 1, "lifetime": f"{LIFETIME}s", "lifetime_stagger": 0}
    workers = {"short": {"cls": Nanny, "options": short}}
    for name in ("a", "b", "c"):
        workers[name] = {"cls": Nanny, "options": {"host": "127.0.0.1", "nthreads": 1}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(4)
        prepare(client)  # each worker's spare rank process (torch imported) starts now
        info = client.scheduler_info(n_workers=-1)["workers"]
        yield client, next(a for a, w in info.items() if w["name"] == "short")


def _gang_search(client: object, objective: object, tmp_path: Path, n_trials: int) -> object:
    study = optuna.create_study(
        storage=optuna.storages.InMemoryStorage(), sampler=optuna.samplers.RandomSampler(seed=5)
    )
    with dask.config.set({"clusterkit.checkpoint-lead": LEAD}):
        return hpo.run(
            objective,  # type: ignore[arg-type]
            n_trials=n_trials,
            client=client,  # type: ignore[arg-type]
            study=study,
            progress=False,
            workdir=None,
            ranks_per_trial=2,
            checkpoint_dir=str(tmp_path / "checkpoints"),
            max_retries=3,
            out=str(tmp_path / "out"),
        )


def collective(trial: optuna.Trial) -> float:
    """STEPS steps of x**2 / STEPS, the ranks in step (an all_reduce a step, as DDP's gradient
    sync); when told, every rank notes the step, rank 0 saves, all leave the save together."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    x = trial.suggest_float("x", -1.0, 1.0)
    folder = hpo.checkpoint_dir(trial)
    saved = folder / "state.json"
    step, total = json.loads(saved.read_text()) if saved.exists() else (0, 0.0)
    with open(folder / f"started-rank{rank}.jsonl", "a") as log:
        log.write(json.dumps(step) + "\n")
    while step < STEPS:
        if hpo.should_checkpoint():
            with open(folder / f"saw-rank{rank}.jsonl", "a") as log:
                log.write(json.dumps(step) + "\n")
            if rank == 0:
                saved.write_text(json.dumps([step, total]))
            dist.barrier()  # a collective: it returns only if every rank is here
            raise hpo.TrialInterrupted(f"saved at step {step}")
        dist.all_reduce(torch.ones(1))
        time.sleep(STEP_SECONDS)
        total += x * x / STEPS
        step += 1
    return total


def _lines(path: Path) -> list[int]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.local
@pytest.mark.timeout(400)
def test_a_gang_on_an_ending_worker_checkpoints_on_every_rank_and_resumes(
    one_short: tuple[object, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    client, short = one_short
    # each launch's end and why are logged: a failure report then says why a launch was retried
    with caplog.at_level(logging.INFO, logger="clusterkit.runners.hpo"):
        study = _gang_search(client, collective, tmp_path, n_trials=2)
    trials = study.get_trials(deepcopy=False)  # type: ignore[attr-defined]
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    for trial in trials:  # the sum of all its steps, whichever workers ran them
        assert trial.value == pytest.approx(trial.params["x"] ** 2)
    on_short = [t for t in trials if short in t.user_attrs.get(inputs.ATTR_GANG, [])]
    assert on_short == [], "a resumed gang went back to the ending worker"
    folders = tmp_path / "checkpoints"
    told = [t for t in trials if (folders / f"trial-{t.number}" / "saw-rank0.jsonl").exists()]
    assert len(told) == 1, "the gang on the short worker did not outlive it"
    (trial,) = told
    folder = folders / f"trial-{trial.number}"
    saw = [_lines(folder / f"saw-rank{rank}.jsonl") for rank in (0, 1)]
    print(f"trial {trial.number}: should_checkpoint() True at step {saw[0]} (rank 0), {saw[1]}")
    assert saw[0] == saw[1] and len(saw[0]) == 1 and 0 < saw[0][0] < STEPS
    for rank in (0, 1):  # the second launch started at the step saved
        assert _lines(folder / f"started-rank{rank}.jsonl") == [0, saw[0][0]]
    assert trial.user_attrs[inputs.ATTR_ATTEMPTS] == 2
    held = account.read(tmp_path / "out")
    assert held is not None
    kinds = held.trials[trial.number]  # its interrupted launch counts toward its outcome
    assert set(kinds) == {"finished"} and held.total["lost"] == 0.0
    seconds = STEPS * STEP_SECONDS  # 2 slots for at least its steps' time
    assert kinds["finished"] >= 2 * seconds, kinds


def torchrun_style(trial: optuna.Trial) -> float:
    """A torchrun script's shape: SIGTERM sets a flag; each rank saves its own state in
    $CLUSTERKIT_CHECKPOINT_DIR and exits; a new launch loads it."""
    import signal

    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    rank = int(os.environ["RANK"])
    x = trial.suggest_float("x", -1.0, 1.0)
    folder = Path(os.environ["CLUSTERKIT_CHECKPOINT_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    mine = folder / f"rank{rank}.json"
    step, total = json.loads(mine.read_text()) if mine.exists() else (0, 0.0)
    with open(folder / f"started-rank{rank}.jsonl", "a") as log:
        log.write(json.dumps(step) + "\n")
    while step < STEPS:
        if stop:
            mine.write_text(json.dumps([step, total]))
            sys.exit(0)
        time.sleep(STEP_SECONDS)
        total += x * x / STEPS
        step += 1
    return total


@pytest.mark.local
@pytest.mark.timeout(400)
def test_a_torchrun_style_gang_that_traps_sigterm_is_resumed_not_failed(
    one_short: tuple[object, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    client, _ = one_short
    with caplog.at_level(logging.INFO, logger="clusterkit.runners.hpo"):
        study = _gang_search(client, torchrun_style, tmp_path, n_trials=2)
    trials = study.get_trials(deepcopy=False)  # type: ignore[attr-defined]
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    for trial in trials:
        assert trial.value == pytest.approx(trial.params["x"] ** 2)
    resumed = [t for t in trials if t.user_attrs.get(inputs.ATTR_ATTEMPTS) == 2]
    assert len(resumed) == 1, [t.user_attrs for t in trials]
    folder = tmp_path / "checkpoints" / f"trial-{resumed[0].number}"
    for rank in (0, 1):  # each rank resumed where it saved
        first, again = _lines(folder / f"started-rank{rank}.jsonl")
        assert first == 0 and 0 < again < STEPS
    said = [r.getMessage() for r in caplog.records]
    print("\n".join(m for m in said if "SIGTERM" in m or "resuming" in m))
    assert any("SIGTERM" in m for m in said) and any("resuming it on workers" in m for m in said)


# ---------------------------------------------------------------------- the account


@pytest.fixture(scope="module")
def pair() -> Iterator[object]:
    from tests.clusters import local_client

    with local_client(2) as connected:
        yield connected


def sleeper(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(1.0)
    return x * x


@pytest.mark.local
@pytest.mark.timeout(300)
def test_a_gang_searchs_account_adds_up_to_the_slots_held(pair: object, tmp_path: Path) -> None:
    """Tolerance: each launch holds its slots from the driver's launch to the driver's notice
    of its last rank's end, which covers the objective's run (ATTR_TIME) and at most SLACK s
    more (the rank's start and the notice, under load)."""
    from tests.clusters import as_new

    slack = 10.0
    with as_new(pair, rank_processes=True) as client:
        began = time.time()
        study = _gang_search(client, sleeper, tmp_path, n_trials=3)
        ended = time.time()
    held = account.read(tmp_path / "out")
    assert held is not None and held.unit == "core"
    print(account.line(held))
    assert held.held == pytest.approx(sum(held.total[k] for k in account.KINDS))
    span = held.until - held.since  # both workers (one thread each) the whole search
    assert began <= held.since and held.until <= ended
    assert held.held == pytest.approx(2 * span, abs=2.0)
    ran = [t.user_attrs[inputs.ATTR_TIME] for t in study.get_trials(deepcopy=False)]
    objective = sum(2 * (end - start) for start, end in ran)
    assert objective <= held.total["finished"] <= objective + 3 * 2 * slack
    assert held.total["lost"] == held.total["failed"] == held.total["pruned"] == 0.0
    assert sorted(held.trials) == [0, 1, 2]


@pytest.mark.unit
def test_the_gang_ledger_counts_k_slots_and_keeps_a_checkpointed_launch() -> None:
    t0 = time.time() - 100.0
    ledger = GangLedger(None, since=t0)
    ledger.seen({"w1": {"nthreads": 1}, "w2": {"nthreads": 2}}, now=t0)
    ledger.launched(0, [("w1", 1.0), ("w2", 2.0)], stamp=t0 + 10)
    ledger.lost(0, stamp=t0 + 20, cause=TrialInterrupted())  # saved: kept for the outcome
    ledger.launched(1, [("w1", 1.0)], stamp=t0 + 30)
    ledger.lost(1, stamp=t0 + 35)  # its worker died: lost
    ledger.launched(0, [("w2", 2.0)], stamp=t0 + 40)
    assert ledger.ended(0, {"state": "COMPLETE"}) == pytest.approx(10.0)  # ended now
    ledger.until = time.time()
    split = ledger.account()
    done = 10 * 3 + (ledger.until - (t0 + 40)) * 2
    assert split.trials[0] == {"finished": pytest.approx(done, abs=0.5)}
    assert split.trials[1] == {"lost": pytest.approx(5.0)}
    assert split.held == pytest.approx(3 * (ledger.until - t0))
    assert split.total["idle"] == pytest.approx(split.held - done - 5.0, abs=0.5)


@pytest.mark.unit
def test_every_rank_gets_rank_zeros_answer_for_the_same_call() -> None:
    decisions: dict[int, bool] = {}
    asking: dict[int, list[str]] = {}
    answers: list[tuple[str, bool]] = []
    verdicts = iter([False, True])

    def ask(rank: int, call: int) -> None:
        msg = {"rank": rank, "call": call, "reply": f"r{rank}c{call}"}
        gang_preemption.agree(decisions, asking, msg, lambda: next(verdicts), _put(answers), "call")

    ask(1, 1)  # before rank 0's: held
    assert answers == []
    ask(0, 1)
    ask(0, 2)
    ask(1, 2)
    assert answers == [("r0c1", False), ("r1c1", False), ("r0c2", True), ("r1c2", True)]


def _put(answers: list[tuple[str, bool]]) -> object:
    return lambda reply, value: answers.append((reply, value))


@pytest.mark.unit
def test_gangs_start_only_where_every_slot_has_the_time_left() -> None:
    now = time.time()
    guard = SimpleNamespace(
        ends={"soon": now + 30, "later": now + 300, "never": None},
        ending_from={"soon": now + 20, "later": now + 290},
        retiring=set(),
    )
    watch = gang_preemption.GangWatch(None, guard)
    slots = [SimpleNamespace(worker=w) for w in ("soon", "later", "never")]
    assert [s.worker for s in watch.usable(slots, None)] == ["soon", "later", "never"]
    assert [s.worker for s in watch.usable(slots, 60.0)] == ["later", "never"]
    guard.ending_from["soon"] = now - 1  # within its lead: no gang starts there
    assert [s.worker for s in watch.usable(slots, None)] == ["later", "never"]
    assert watch.ending(["never", "soon"], now).startswith("worker soon ends in")
    assert watch.ending(["never", "later"], now) is None
    watch.seen({"later": {"status": "closing_gracefully"}, "never": {"status": "running"}})
    assert watch.ending(["never", "later"], now) == "worker later is retiring"  # retire_workers
    assert [s.worker for s in watch.usable(slots, None)] == ["never"]


@pytest.mark.unit
def test_idle_workers_with_less_left_than_the_shortest_gang_retire() -> None:
    now = time.time()
    retired: list[tuple[tuple[str, ...], float | None]] = []

    def retire(workers: tuple[str, ...], need: float | None) -> None:
        guard.retiring.update(workers)
        retired.append((workers, need))

    guard = SimpleNamespace(
        ends={"a": now + 20, "b": now + 25, "c": now + 300, "d": None},
        ending_from={},
        retiring=set(),
        retire=retire,
    )
    watch = gang_preemption.GangWatch(None, guard)
    watch.retire_short({"a", "b", "c", "d"}, None)  # no likely duration yet: none retires
    watch.retire_short({"b", "c", "d"}, 60.0)  # "a" holds a gang's slot: it stays
    assert retired == [(("b",), 60.0)]
    watch.retire_short({"a", "b", "c", "d"}, 60.0)  # "b" is retiring already
    assert retired == [(("b",), 60.0), (("a",), 60.0)]
    slots = [SimpleNamespace(worker=w) for w in ("a", "b", "c", "d")]
    assert [s.worker for s in watch.usable(slots, 5.0)] == ["c", "d"]  # none on a retiring one


@pytest.mark.unit
def test_a_gang_killed_at_the_end_of_its_grace_is_lost_and_one_that_ended_is_kept() -> None:
    from clusterkit.runners.ddp.worker import RankError

    now = time.time()
    guard = SimpleNamespace(ends={"w": now + 5, "v": None}, ending_from={"w": now - 1})
    signalled: list[tuple[str, list[str]]] = []
    client = SimpleNamespace(
        run=lambda fn, key, workers, on_error: signalled.append((key, workers))
    )
    watch = gang_preemption.GangWatch(client, guard)
    ended = SimpleNamespace(status="finished")
    for number in (0, 1, 2):
        watch.launched(number, f"k{number}", ["w", "v"] if number < 2 else ["v"])
    assert watch.tell(0) and watch.tell(1) and not watch.tell(2)  # trial 2 is on "v" only
    deadline = time.monotonic() + 10  # sent off the loop's thread
    while len(signalled) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(signalled) == [("k0", ["v", "w"]), ("k1", ["v", "w"])]  # SIGTERM to every rank
    assert watch.notices[0].kill_at == pytest.approx(now + 5)  # SIGKILL at the worker's end
    why, saved = watch.interrupted(0, [ended, ended])  # type: ignore[misc]
    assert why.startswith("worker w ends in ") and saved
    assert why.endswith("s: its ranks were told to end, and ended")
    watch.notices[1].kill_at = time.time() - 0.1  # its grace ran out
    gang = SimpleNamespace(number=1, key="k1", failed=False)
    killed: list[object] = []
    watch.check([gang], killed.append)
    assert killed == [gang]
    assert watch.interrupted(1, [ended]).saved is False  # type: ignore[union-attr]
    error = RankError(1, "TrialInterrupted", "saved at step 3", "", 0.0)
    raised = SimpleNamespace(status="error", exception=lambda: error)
    assert watch.interrupted(2, [ended, raised]) == (
        "rank 1 saved a checkpoint (saved at step 3)",
        True,
    )
    assert watch.interrupted(3, [ended]) is None  # not told, nothing raised: not interrupted


@pytest.mark.unit
def test_sigterm_from_the_batch_system_to_any_rank_ends_the_gang_at_the_same_call() -> None:
    """The batch system signals the processes of the job it ends, rank 0's or another's: the
    first rank that got it decides for every rank, from the call at which it asks."""
    guard = SimpleNamespace(ends={"w": None, "v": None}, ending_from={})
    client = SimpleNamespace(run=lambda fn, key, workers, on_error: None)
    watch = gang_preemption.GangWatch(client, guard)
    watch.launched(0, "k0", ["w", "v"])
    answers: list[tuple[str, bool]] = []

    def ask(rank: int, call: int, signalled: bool) -> None:
        msg = {"rank": rank, "call": call, "signalled": signalled, "reply": f"r{rank}c{call}"}
        watch.answer(0, msg, lambda reply, value: answers.append((reply, value)))

    ask(0, 0, False)
    ask(1, 0, False)
    ask(1, 1, True)  # rank 1's job got SIGTERM: its answer waits for rank 0's call 1
    assert answers == [("r0c0", False), ("r1c0", False)]
    ask(0, 1, False)
    assert answers[2:] == [("r0c1", True), ("r1c1", True)]
    assert watch.notices[0].why == "its rank 1 got SIGTERM"
