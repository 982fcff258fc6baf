"""Gang-scheduled multi-rank trials (``ranks_per_trial``) on a real LocalCluster of 4 workers:
DDP ranks with gloo, the same parameters on every rank, gangs side by side without deadlock,
failures retried whole, pruning on every rank at the same step."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.ddp.placement import Slot
from clusterkit.runners.hpo import gangs, timeline
from clusterkit.runners.hpo.inputs import ATTR_ATTEMPTS, ATTR_ERROR, ATTR_GANG, ATTR_TIME

pytestmark = pytest.mark.local
optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """One cluster of 4 workers for the module: no test here kills or adds workers."""
    from tests.clusters import local_client

    with local_client(4, dashboard=True) as connected:
        yield connected


@pytest.fixture
def client(cluster: object) -> Iterator[object]:
    """The module's cluster as a new one: its rank processes end with each test."""
    from tests.clusters import as_new

    with as_new(cluster, rank_processes=True) as connected:
        yield connected


def _search(client: object, objective: object, n_trials: int, **options: object) -> optuna.Study:
    study = optuna.create_study(
        storage=optuna.storages.InMemoryStorage(),
        sampler=optuna.samplers.RandomSampler(seed=3),
        pruner=options.pop("pruner", None),  # type: ignore[arg-type]
    )
    for params in options.pop("enqueue", ()):  # type: ignore[attr-defined]
        study.enqueue_trial(params)
    return hpo.run(
        objective,  # type: ignore[arg-type]
        n_trials=n_trials,
        client=client,  # type: ignore[arg-type]
        study=study,
        progress=False,
        workdir=None,
        **options,  # type: ignore[arg-type]
    )


def _overlap(a: optuna.trial.FrozenTrial, b: optuna.trial.FrozenTrial) -> bool:
    (start_a, end_a), (start_b, end_b) = a.user_attrs[ATTR_TIME], b.user_attrs[ATTR_TIME]
    return start_a < end_b and start_b < end_a


# ---------------------------------------------------------------------- placement, no cluster


def _slots(hosts: dict[str, int]) -> list[Slot]:
    return [
        Slot(f"tcp://{host}:{i}", host, 0, False, 1)
        for host, count in hosts.items()
        for i in range(count)
    ]


def test_pack_takes_the_fullest_fitting_host_and_spread_one_per_host() -> None:
    free = _slots({"a": 3, "b": 2, "c": 1})
    assert {s.host for s in gangs.choose(free, 2, "pack") or []} == {"b"}
    assert [s.host for s in gangs.choose(free, 3, "spread") or []] == ["a", "b", "c"]
    assert gangs.choose(free, 7) is None


def test_a_small_trial_fills_a_gap_only_when_the_head_is_not_delayed() -> None:
    free = _slots({"a": 1})
    waiting = [gangs.Waiting(1, 4), gangs.Waiting(2, 1)]
    running = [gangs.Running(3, end=10.0)]  # the head can start at t=10
    short, long = (lambda size: 5.0), (lambda size: 50.0)
    assert [n for n, _ in gangs.plan(waiting, free, running, short, now=0.0)] == [2]
    assert gangs.plan(waiting, free, running, long, now=0.0) == []
    unknown = [gangs.Running(3, end=None)]
    assert gangs.plan(waiting, free, unknown, short, now=0.0) == []


# ---------------------------------------------------------------------- gangs on a cluster


def same_params_objective(trial: optuna.Trial) -> float:
    import torch.distributed as dist

    x = trial.suggest_float("x", 0.0, 1.0)
    n = trial.suggest_int("n", 1, 1000)
    dist.init_process_group("gloo")  # left initialised: the runner destroys it
    seen: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, [x, n, os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]])
    time.sleep(1.5)
    trial.set_user_attr("seen", seen)
    return x


def test_two_gangs_of_two_run_side_by_side_with_the_same_params(client: object) -> None:
    study = _search(client, same_params_objective, 4, ranks_per_trial=2)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    ports = set()
    for trial in trials:
        seen = trial.user_attrs["seen"]
        x, n = trial.params["x"], trial.params["n"]
        assert seen == [[x, n, "2", seen[0][3]]] * 2  # both ranks: same values, world size 2
        ports.add(seen[0][3])
        assert len(set(trial.user_attrs[ATTR_GANG])) == 2
    assert len(ports) == 4  # each trial its own rendezvous port
    pairs = list(itertools.combinations(trials, 2))
    assert any(_overlap(a, b) for a, b in pairs), "gangs never ran side by side"
    for a, b in pairs:  # gangs side by side never share a worker
        if _overlap(a, b):
            assert not set(a.user_attrs[ATTR_GANG]) & set(b.user_attrs[ATTR_GANG])
    rows: dict[str, set[str]] = {}  # the report's timeline: each trial on both its workers
    for bars in timeline.timeline_plotly(study).data:
        for label, worker in zip(bars.text, bars.y, strict=True):
            rows.setdefault(label, set()).add(worker)
    assert rows == {f"#{t.number} (k=2)": set(t.user_attrs[ATTR_GANG]) for t in trials}


def study_minded_ranks(trial: optuna.Trial) -> float:
    """Every rank reads its study (from the driver: a rank keeps no mirror); rank 0 writes
    Optuna's system attributes, as its constraints and artifacts do."""
    rank = os.environ["RANK"]
    finished = trial.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    trial.set_user_attr(f"seen-{rank}", [trial.study.user_attrs["tag"], len(finished)])
    if hasattr(trial, "set_constraint"):  # Optuna 5
        trial.set_constraint("c", -1.0)
    else:  # Optuna 4 (the compat tier's floor): the system attribute set_constraint writes
        trial.set_system_attr("constraints:c", -1.0)
    return trial.suggest_float("x", 0.0, 1.0)


@pytest.mark.seam
def test_a_gang_trial_reads_its_study_and_keeps_its_system_attributes(client: object) -> None:
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    study.set_user_attr("tag", "gang")
    hpo.run(
        study_minded_ranks, n_trials=3, client=client, study=study, progress=False,
        workdir=None, ranks_per_trial=2, lookahead=0,
    )  # fmt: skip
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert all(t.system_attrs["constraints:c"] == -1.0 for t in trials)
    assert {t.user_attrs["seen-0"][0] for t in trials} == {"gang"}
    assert max(t.user_attrs["seen-0"][1] for t in trials) >= 1  # later ones see earlier ones


@pytest.mark.seam
def test_an_enqueued_trials_fixed_params_are_taken_on_every_rank_without_asking(
    client: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clusterkit.runners.hpo.gang_loop import GangLoop

    asked: list[str] = []
    suggest = GangLoop._suggest

    def counted(self: GangLoop, attempt: object, msg: dict) -> dict:
        asked.append(msg["name"])
        return suggest(self, attempt, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(GangLoop, "_suggest", counted)
    enqueue = [{"x": 0.25}, {"x": 0.75}]
    study = _search(client, same_params_objective, 2, ranks_per_trial=2, enqueue=enqueue)
    trials = study.get_trials()
    assert [t.params["x"] for t in trials] == [0.25, 0.75]  # reported by rank 0
    for trial in trials:
        assert trial.distributions["x"] == optuna.distributions.FloatDistribution(0.0, 1.0)
        x, n = trial.params["x"], trial.params["n"]
        assert [seen[:2] for seen in trial.user_attrs["seen"]] == [[x, n]] * 2
    assert "x" not in asked  # Optuna's fixed parameter, on each rank
    assert "n" in asked  # the driver samples the others, the same for every rank


def sized_objective(trial: optuna.Trial) -> float:
    import torch.distributed as dist

    k = trial.suggest_categorical("k", [1, 2, 4])
    dist.init_process_group("gloo")
    assert dist.get_world_size() == k
    dist.barrier()
    time.sleep(0.3)
    return float(k)


def test_mixed_sizes_from_a_function_finish_without_deadlock(client: object) -> None:
    sizes = [2, 4, 1, 2, 1, 4, 1]
    study = _search(
        client,
        sized_objective,
        len(sizes),
        ranks_per_trial=lambda params: params.get("k", 1),
        enqueue=[{"k": k} for k in sizes],
    )
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * len(sizes)
    assert [len(t.user_attrs[ATTR_GANG]) for t in trials] == sizes


def leaky_objective(trial: optuna.Trial) -> float:
    """Leaves what scripts leave: a process group, an environment variable, another working
    directory; records what it found on arrival."""
    import tempfile

    import torch.distributed as dist

    trial.suggest_int("i", 0, 100)
    found = [os.getpid(), os.environ.get("CK_TEST_LEAK"), os.getcwd(), dist.is_initialized()]
    dist.init_process_group("gloo")
    dist.barrier()
    os.environ["CK_TEST_LEAK"] = str(trial.number)
    os.chdir(tempfile.gettempdir())
    trial.set_user_attr("found", found)
    return 0.0


def _leaky_search(client: object) -> list[optuna.trial.FrozenTrial]:
    study = _search(client, leaky_objective, 6, ranks_per_trial=2)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 6
    for trial in trials:  # each trial starts clean, whichever process serves it
        _, leak, cwd, initialised = trial.user_attrs["found"]
        assert (leak, initialised) == (None, False), trial.user_attrs["found"]
        assert cwd == trials[0].user_attrs["found"][2]
    return trials


def test_rank_processes_serve_the_next_trial_of_the_search_clean(client: object) -> None:
    pids = [t.user_attrs["found"][0] for t in _leaky_search(client)]
    assert len(set(pids)) < len(pids), f"no rank 0 process served two trials: {pids}"


def _set_env(name: str, value: str) -> None:
    os.environ[name] = value


def test_without_reuse_every_trial_gets_new_rank_processes(client: object) -> None:
    from clusterkit.runners.ddp.pool import REUSE_ENV

    client.run(_set_env, REUSE_ENV, "0")  # type: ignore[attr-defined]
    pids = [t.user_attrs["found"][0] for t in _leaky_search(client)]
    assert len(set(pids)) == len(pids), f"a rank 0 process served two trials: {pids}"


def sibling_objective(trial: optuna.Trial) -> float:
    """The other rank processes beside this one on its worker (spares, warm ones), by pid."""
    import psutil

    me = psutil.Process()
    argv = ("clusterkit.runners.ddp.rank",)
    siblings = [
        p.pid
        for p in me.parent().children()
        if p.pid != me.pid and any(a in argv for a in p.cmdline())
    ]
    trial.set_user_attr("siblings", siblings)
    return trial.suggest_float("x", 0.0, 1.0)


def _rank_processes(dask_worker: object) -> list[list[str]]:
    """The command lines of this worker's rank processes."""
    import psutil

    children = psutil.Process().children()
    return [p.cmdline() for p in children if "clusterkit.runners.ddp.rank" in p.cmdline()]


def _wait_for_spares(client: Any) -> None:
    """Until every worker's spare rank process is ready (2 minutes at most). Not
    ``ddp.driver.wait_ready``: from a new client it registers the spares' plugin again, which
    ends every rank process first, warm ones included."""
    from clusterkit.runners.ddp.pool import spare_ready

    deadline = time.monotonic() + 120
    while not all(client.run(spare_ready).values()):
        assert time.monotonic() < deadline, "no spare rank process after the search"
        time.sleep(0.2)


def test_a_searchs_warm_rank_process_stands_in_for_the_spare_till_the_search_ends(
    client: object,
) -> None:
    """A search's first trial on a worker takes its spare; the rank process is kept warm and
    serves the next trials, so no new spare imports torch beside them (8 such imports on 2
    cores made bench/gangs.py 1.5-2x its lower bound). The spare is back once the search ends,
    with the gang rank code imported (each search's first trials on 8 workers imported Optuna
    side by side: 100-260 ms before rank 0 started, against 10-30 ms later)."""
    study = _search(client, sibling_objective, 8, ranks_per_trial=4)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 8
    later = [t.user_attrs["siblings"] for t in trials[1:]]
    assert later == [[]] * 7, f"rank processes beside a warm one during the search: {later}"
    _wait_for_spares(client)
    spares = client.run(_rank_processes).values()  # type: ignore[attr-defined]
    assert all(len(p) == 1 for p in spares), spares
    assert all(
        "clusterkit.runners.hpo.gang_rank" in p[0][p[0].index("--preload") :] for p in spares
    )


def test_a_release_after_the_rank_processes_ended_starts_none(client: object) -> None:
    """A search's release (``client.run(..., wait=False)``) can reach a worker after its rank
    processes were ended (a closing worker, a test's cleanup): with no warm process of that
    search to end, it starts no spare either, so no rank process outlives the cleanup (CI: a
    spare started after the cleanup was killed 15 s later while the next test's first trial
    took it)."""
    from clusterkit.runners.ddp.pool import end_all, release_soon

    client.run(end_all)  # type: ignore[attr-defined]
    client.run(release_soon, "clusterkit-hpo-ended", wait=False)  # type: ignore[attr-defined]
    time.sleep(1.0)  # a spare, once started, is a child of its worker at once
    left = client.run(_rank_processes).values()  # type: ignore[attr-defined]
    assert all(p == [] for p in left), left


def test_gang_searches_from_one_client_after_another_leave_each_worker_its_spare(
    tmp_path: Path,
) -> None:
    """What a user of ``clusterkit up`` does: each script connects, runs a gang search and
    closes its client at once. The search's release reaches the scheduler before it returns
    and the scheduler sees it through, so after each one every worker holds its spare alone
    (gang rank code imported), no warm rank process of a closed client's search."""
    from clusterkit import api
    from clusterkit.client import get_client
    from tests.contract import assert_gangs_of_two, gang_search, shipped_by_value

    profile = tmp_path / "gangs-up.yaml"
    profile.write_text("backend: local\nworkers: 2\nworker: {threads: 1, memory: 2GiB}\n")
    record = api.up(profile)
    try:
        for _ in range(2):
            with get_client(record.name) as client, shipped_by_value():
                client.wait_for_workers(2, timeout=120)
                assert_gangs_of_two(gang_search(client, 3), 3)
            with get_client(record.name) as looking:
                _wait_for_spares(looking)
                left = list(looking.run(_rank_processes).values())
            assert [len(p) for p in left] == [1, 1], left
            assert all("clusterkit.runners.hpo.gang_rank" in p[0] for p in left), left
    finally:
        api.down(record.name)


def failing_objective(trial: optuna.Trial, marker_dir: Path) -> float:
    """Rank 1 of trial 0 is killed by a signal once (out of memory, a walltime's kill): the
    cluster ended it. Trial 1's rank 1 exits with a code of its own, trial 2's raises: the
    objective ended those, every attempt would do the same."""
    import signal

    import torch.distributed as dist

    x = trial.suggest_float("x", 0.0, 1.0)
    dist.init_process_group("gloo")
    marker = marker_dir / f"{trial.number}"
    if os.environ["RANK"] == "1" and not marker.exists():
        marker.touch()
        if trial.number == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if trial.number == 1:
            os._exit(3)  # the rank process exits on its own
        raise ValueError(f"rank 1 fails trial {trial.number}")
    dist.barrier()
    return x


def test_only_a_rank_the_cluster_ended_is_retried(client: object, tmp_path: Path) -> None:
    from functools import partial

    objective = partial(failing_objective, marker_dir=tmp_path)
    study = _search(client, objective, 3, ranks_per_trial=2, max_retries=2)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "FAIL"]
    assert trials[0].user_attrs[ATTR_ATTEMPTS] == 2  # killed once, then it completed
    assert [ATTR_ATTEMPTS in t.user_attrs for t in trials[1:]] == [False, False]  # ran once
    assert trials[1].user_attrs[ATTR_ERROR].startswith("rank 1: ProcessExit: ")
    assert trials[2].user_attrs[ATTR_ERROR] == "rank 1: ValueError: rank 1 fails trial 2"


def pruned_objective(trial: optuna.Trial, marker_dir: Path) -> float:
    import torch
    import torch.distributed as dist

    x = trial.suggest_float("x", 0.0, 1.0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(3):
        total = torch.tensor([1.0])
        dist.all_reduce(total)  # ranks in lockstep: a rank left behind would hang
        trial.report(x + step * 0.1, step)
        if trial.should_prune():
            (marker_dir / f"{trial.number}-{rank}").write_text(str(step))
            raise optuna.TrialPruned()
    return x


def test_a_pruned_trial_stops_on_every_rank_at_the_same_step(
    client: object, tmp_path: Path
) -> None:
    from functools import partial

    study = _search(
        client,
        partial(pruned_objective, marker_dir=tmp_path),
        3,
        ranks_per_trial=2,
        pruner=optuna.pruners.ThresholdPruner(upper=0.5),
        enqueue=[{"x": 0.05}, {"x": 0.35}, {"x": 0.6}],
    )
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "PRUNED"]
    for trial, step in [(trials[1], 2), (trials[2], 0)]:
        stops = [(tmp_path / f"{trial.number}-{rank}").read_text() for rank in (0, 1)]
        assert stops == [str(step)] * 2
        assert max(trial.intermediate_values) == step
    assert not list(tmp_path.glob("0-*"))


def resuming_objective(trial: optuna.Trial, marker_dir: Path) -> float:
    """Rank 0 checkpoints each step; the first attempt of every trial dies after step 1, the
    retry resumes from the checkpoint (never from step 0)."""
    import signal

    import torch.distributed as dist

    from clusterkit.runners.hpo import rank_context

    x = trial.suggest_float("x", 0.0, 1.0)
    dist.init_process_group("gloo")
    ctx = rank_context()
    state = ctx.load_checkpoint() or {"step": 0}
    (marker_dir / f"{trial.number}-{ctx.rank}-from-{state['step']}").touch()
    for step in range(state["step"], 3):
        dist.barrier()
        if ctx.rank == 0:
            ctx.save_checkpoint({"step": step + 1})
        dist.barrier()
        if step == 1 and ctx.restart_count == 1:  # killed, as by the out-of-memory killer
            os.kill(os.getpid(), signal.SIGKILL)
    return x


@pytest.mark.parametrize("where", ["checkpoint-dir", "scheduler"])
def test_a_retried_trial_resumes_from_its_checkpoint(
    client: object, tmp_path: Path, where: str
) -> None:
    from functools import partial

    markers = tmp_path / "markers"
    markers.mkdir()
    checkpoints = tmp_path / "ckpt" if where == "checkpoint-dir" else None
    objective = partial(resuming_objective, marker_dir=markers)
    options: dict[str, object] = {"ranks_per_trial": 2, "max_retries": 1}
    if checkpoints is not None:
        options["checkpoint_dir"] = str(checkpoints)
    study = _search(client, objective, 2, **options)
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "COMPLETE"]
    started = sorted(p.name for p in markers.iterdir())
    assert started == [f"{n}-{r}-from-{s}" for n in (0, 1) for r in (0, 1) for s in (0, 2)]
    if checkpoints is not None:  # a folder per trial
        assert sorted(p.name for p in checkpoints.iterdir()) == ["trial-0", "trial-1"]
    deadline = time.monotonic() + 10  # a variable's deletion is a message, not waited for
    while left := client.run_on_scheduler(_search_state):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"left on the scheduler after the search: {left}"
        time.sleep(0.1)


def _search_state(dask_scheduler: object) -> list[str]:
    """Names of searches' events and variables on the scheduler (checkpoints, ports)."""
    extensions = dask_scheduler.extensions  # type: ignore[attr-defined]
    names = [*extensions["events"]._events, *extensions["variables"].variables]
    return [name for name in names if str(name).startswith("clusterkit-hpo-")]
