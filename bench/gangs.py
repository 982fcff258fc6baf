"""Gang-scheduled trials (issue 25): mixed-size sleep trials on 8 slots vs a static partition.

Both sides run the same trials: sizes k in {1, 2, 4} and sleep durations t ~ U(0.5, 3) s drawn
from a seeded RNG, enqueued as each trial's parameters ``k`` and ``t`` (every rank sleeps t).

- **gangs**: one search, ``hpo.run(..., ranks_per_trial=lambda p: p["k"], placement="pack")``
  on a LocalCluster of 8 single-thread workers (8 slots), under the loop's placement policy
  (``largest first``: :class:`clusterkit.runners.hpo.gangs.GangPolicy`);
- **gangs, in order**: the same search under the policy before it (``in order``:
  :class:`~clusterkit.runners.hpo.gangs.InOrderPolicy`, trials start in line order with EASY
  backfilling), switched in by the bench on the same cluster;
- **static partition**: the usual workaround, one search per fixed group of slots: a cluster of
  4 workers for the k=4 trials, one of 2 for the k=2 trials and two of 1 for the k=1 trials
  (split alternately), the four searches run at the same time (one thread each); the same 8
  worker processes in all.

Makespan is each side's wall time (``hpo.run`` call(s) to return), against the lower bound
max(sum(k_i t_i) / slots, max t_i); utilisation is sum(k_i t_i) / (slots x makespan). Launch
overhead per trial: from the gang's launch (stamped in this process by wrapping the gang loop's
``_launch``) to rank 0's objective start (``ck_time``); slot overhead: how long a gang held its
slots beyond t; a search's fixed costs: from the call to its first launch, and from its last
gang's end to its return. Repetitions are interleaved, order alternating; medians are reported.

    .venv/bin/python bench/gangs.py --reps 1 --trials 24 --seed 0

``--fresh-ranks`` adds a third side: the same gang search with every trial's ranks in new
processes (``CLUSTERKIT_DDP_REUSE=0``), as before rank processes were reused. The line under the
table's "zero overhead" column gives each gang policy's own makespan with every launch instant
(``_gang_schedule``, simulated): what the policy costs, apart from launching.

Target (issue 25): gang makespan within 1.10x of the lower bound.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gang_schedule import POLICIES, zero_overhead_makespan
from _side_by_side import compile_clusterkit
from hpo import cluster_security

SLOTS = 8
SIZES = (1, 2, 4)
#: the static partition: slots per group, and the trial size each group runs
GROUPS = ((4, 4), (2, 2), (1, 1), (1, 1))
TARGET = 1.10


def draw(n: int, seed: int) -> list[tuple[int, float]]:
    """(k, t) per trial: sizes uniform over SIZES, durations uniform over [0.5, 3] s."""
    rng = np.random.default_rng(seed)
    sizes = rng.choice(SIZES, size=n)
    times = rng.uniform(0.5, 3.0, size=n)
    return [(int(k), round(float(t), 3)) for k, t in zip(sizes, times, strict=True)]


def lower_bound(trials: list[tuple[int, float]], slots: int = SLOTS) -> float:
    return max(sum(k * t for k, t in trials) / slots, max(t for _, t in trials))


def sleep_objective(trial: Any) -> float:
    trial.suggest_categorical("k", list(SIZES))
    t = trial.suggest_float("t", 0.0, 10.0)
    time.sleep(t)
    return t


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ------------------------------------------------------------------ stamps from the gang loop

STAMPS: dict[str, dict[tuple[str, int], float]] = {"launch": {}, "freed": {}}
_STAMPS_LOCK = threading.Lock()
POLICY = [POLICIES[0]]  # the placement policy the next gang search runs under


def stamp_gang_loop() -> None:
    """Wrap GangLoop._launch/_ended to stamp wall-clock launch and slot-release times.

    Keyed by (study name, trial number) - the last launch of a trial counts."""
    from clusterkit.runners.hpo import gang_loop, gangs

    init, launch, ended = (
        gang_loop.GangLoop.__init__,
        gang_loop.GangLoop._launch,
        gang_loop.GangLoop._ended,
    )

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.policy = gangs.InOrderPolicy() if POLICY[0] == "in order" else gangs.GangPolicy()

    def _launch(self: Any, attempt: Any, slots: Any) -> None:
        with _STAMPS_LOCK:
            STAMPS["launch"][(self.study.study_name, attempt.number)] = time.time()
        launch(self, attempt, slots)

    def _ended(self: Any, attempt: Any) -> None:
        with _STAMPS_LOCK:
            STAMPS["freed"][(self.study.study_name, attempt.number)] = time.time()
        ended(self, attempt)

    gang_loop.GangLoop.__init__ = __init__  # type: ignore[method-assign]
    gang_loop.GangLoop._launch = _launch  # type: ignore[method-assign]
    gang_loop.GangLoop._ended = _ended  # type: ignore[method-assign]


# ------------------------------------------------------------------ the two sides


def search(client: Any, trials: list[tuple[int, float]], name: str, ranks: Any) -> Any:
    import optuna

    from clusterkit.runners import hpo

    study = optuna.create_study(
        study_name=name,
        storage=optuna.storages.InMemoryStorage(),
        sampler=optuna.samplers.RandomSampler(seed=0),
    )
    for k, t in trials:
        study.enqueue_trial({"k": k, "t": t})
    return hpo.run(
        sleep_objective,
        n_trials=len(trials),
        client=client,
        study=study,
        progress=False,
        workdir=None,
        ranks_per_trial=ranks,
        placement="pack",
    )


def overheads(study: Any) -> tuple[list[float], list[float]]:
    """Per trial: launch -> rank 0's objective start; slots held beyond t (gang trials only)."""
    from clusterkit.runners.hpo.inputs import ATTR_TIME

    launch, held = [], []
    for trial in study.get_trials():
        key = (study.study_name, trial.number)
        if key not in STAMPS["launch"]:
            continue
        start, _ = trial.user_attrs[ATTR_TIME]
        launch.append(start - STAMPS["launch"][key])
        held.append(STAMPS["freed"][key] - STAMPS["launch"][key] - trial.params["t"])
    return launch, held


def check(study: Any, trials: list[tuple[int, float]]) -> None:
    from clusterkit.runners.hpo.inputs import ATTR_GANG

    done = study.get_trials()
    states = {t.state.name for t in done}
    if states != {"COMPLETE"} or len(done) != len(trials):
        raise RuntimeError(f"{study.study_name}: {len(done)} trials, states {states}")
    for t in done:
        gang = t.user_attrs.get(ATTR_GANG)
        if gang is not None and len(set(gang)) != t.params["k"]:
            raise RuntimeError(f"{study.study_name} trial {t.number}: gang {gang}")


def _set_reuse(value: str) -> None:
    import os

    from clusterkit.runners.ddp.pool import REUSE_ENV

    os.environ[REUSE_ENV] = value


def run_gangs(
    client: Any,
    trials: list[tuple[int, float]],
    rep: int,
    fresh: bool = False,
    policy: str = POLICIES[0],
) -> dict[str, Any]:
    """One gang search under ``policy``; ``fresh``: every trial's ranks in new processes (the
    behaviour before rank processes were reused across a search's trials), on the same workers."""
    client.run(_set_reuse, "0" if fresh else "1")
    POLICY[0] = policy
    name = f"gangs-{rep}-{'fresh' if fresh else 'reused'}-{policy.replace(' ', '-')}"
    started, wall = time.perf_counter(), time.time()
    study = search(client, trials, name, _size)
    makespan = time.perf_counter() - started
    POLICY[0] = POLICIES[0]
    edges = _edges(name, wall, wall + makespan)
    client.run(_set_reuse, "1")
    check(study, trials)
    launch, held = overheads(study)
    if TIMELINE and rep == 0 and not fresh and policy == POLICIES[0]:
        save_timeline(study, TIMELINE[0])
    return {"makespan": makespan, "launch": launch, "held": held, "edges": edges}


def _edges(name: str, called: float, returned: float) -> tuple[float, float]:
    """A search's fixed costs: from ``hpo.run``'s call to its first gang's launch, and from its
    last gang's slots freed to its return (wall-clock seconds)."""
    with _STAMPS_LOCK:
        launches = [t for (study, _), t in STAMPS["launch"].items() if study == name]
        freed = [t for (study, _), t in STAMPS["freed"].items() if study == name]
    return min(launches) - called, returned - max(freed)


TIMELINE: list[str] = []  # --timeline PATH: the first gang search's timeline picture


def save_timeline(study: Any, path: str) -> None:
    """The search's timeline as report.html draws it: each trial on every worker it held."""
    from clusterkit.runners.hpo.timeline import pyplot, timeline_matplotlib

    figure = timeline_matplotlib(study)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(figure)


def _size(params: dict[str, Any]) -> int:
    return int(params["k"])


def static_split(trials: list[tuple[int, float]]) -> list[list[tuple[int, float]]]:
    """Each group's trials, in trial order; groups of the same size class take turns."""
    parts: list[list[tuple[int, float]]] = [[] for _ in GROUPS]
    turn = dict.fromkeys(SIZES, 0)
    for k, t in trials:
        groups = [i for i, (_, size) in enumerate(GROUPS) if size == k]
        parts[groups[turn[k] % len(groups)]].append((k, t))
        turn[k] += 1
    return parts


def run_static(clients: list[Any], trials: list[tuple[int, float]], rep: int) -> dict[str, Any]:
    parts = static_split(trials)
    studies: list[Any] = [None] * len(GROUPS)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            if parts[i]:
                size = GROUPS[i][1]
                studies[i] = search(clients[i], parts[i], f"static-{rep}-g{i}", size)
        except BaseException as error:  # reported after the join
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(GROUPS))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    makespan = time.perf_counter() - started
    if errors:
        raise errors[0]
    launch: list[float] = []
    held: list[float] = []
    for study, part in zip(studies, parts, strict=True):
        if study is not None:
            check(study, part)
            a, b = overheads(study)
            launch += a
            held += b
    return {"makespan": makespan, "launch": launch, "held": held}


def static_ideal(trials: list[tuple[int, float]]) -> float:
    """The static partition's makespan with zero overhead: each group runs its trials back to
    back (a group's trials all fill it)."""
    return max(sum(t for _, t in part) for part in static_split(trials))


# ------------------------------------------------------------------ driver


def start(n_workers: int) -> tuple[Any, Any]:
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=None,
        **cluster_security(),
    )
    client = Client(cluster)
    client.wait_for_workers(n_workers)
    return cluster, client


def warm(client: Any, gangs: bool) -> None:
    """Imports on the workers and, for gang searches, the spare rank processes, with what a
    gang search's ranks import (torch, and the gang runner's rank code with Optuna), as a search
    leaves them for the next. Without the latter every rank of the first wave imports Optuna at
    once (about 0.5 s of both cores here), a once-per-worker cost outside the launch path."""
    from clusterkit.runners.ddp.driver import prepare, wait_ready
    from clusterkit.runners.hpo import gang_rank

    client.run(__import__, "clusterkit.runners.hpo.worker")
    if gangs:
        prepare(client, (gang_rank.__name__,))  # the spares' plugin: imports as a search's
        wait_ready(client, timeout=180)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", help="save the first gang search's timeline PNG here")
    parser.add_argument(
        "--fresh-ranks", action="store_true", help="also run gangs without rank process reuse"
    )
    parser.add_argument(
        "--simulate", action="store_true", help="only the policies with zero overhead, per seed"
    )
    args = parser.parse_args()
    if args.simulate:
        simulate_only(args)
        return
    TIMELINE[:] = [args.timeline] if args.timeline else []

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    stamp_gang_loop()
    compile_clusterkit()  # rank processes import clusterkit: from bytecode, as installed

    started: list[tuple[Any, Any]] = []
    try:
        started.append(start(SLOTS))
        for slots, _ in GROUPS:
            started.append(start(slots))
        gang_client = started[0][1]
        static_clients = [client for _, client in started[1:]]
        warm(gang_client, gangs=True)
        for (_, size), client in zip(GROUPS, static_clients, strict=True):
            warm(client, gangs=size > 1)
        # untimed: the first gang search of a run pays one-off costs (in 3 runs it took
        # 30-32 s, the next search on the same trials 16-18 s)
        run_gangs(gang_client, draw(2 * SLOTS, args.seed + 1000), -1)

        sides = {
            f"gangs, {POLICIES[0]} (one search, 8 slots)": lambda t, r: run_gangs(
                gang_client, t, r
            ),
            f"gangs, {POLICIES[1]} (the policy before)": lambda t, r: run_gangs(
                gang_client, t, r, policy=POLICIES[1]
            ),
            "static partition 4+2+1+1": lambda t, r: run_static(static_clients, t, r),
        }
        if args.fresh_ranks:
            sides["gangs, fresh rank processes per trial"] = lambda t, r: run_gangs(
                gang_client, t, r, fresh=True
            )
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        bounds, ideals, work = [], [], []
        for rep in range(args.reps):
            trials = draw(args.trials, args.seed + rep)
            bound = lower_bound(trials)
            bounds.append(bound)
            ideals.append(static_ideal(trials))
            work.append(sum(k * t for k, t in trials))
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for name in order:
                settle(gang_client, static_clients)
                result = sides[name](trials, rep)
                result["bound"], result["work"] = bound, work[-1]
                result["simulated"] = simulated(name, trials)
                results[name].append(result)
                print(
                    f"rep {rep} {name}: makespan {result['makespan']:.2f}s bound {bound:.2f}s "
                    f"ratio {result['makespan'] / bound:.3f}" + _edges_text(result),
                    flush=True,
                )
    finally:
        for cluster, client in reversed(started):
            client.close()
            try:
                cluster.close(timeout=30)
            except Exception as error:  # a slow nanny at teardown must not lose the results
                print(f"warning: closing a cluster: {error!r}", flush=True)

    report(args, results, bounds, ideals)


def _edges_text(result: dict[str, Any]) -> str:
    if "edges" not in result:
        return ""
    first, last = result["edges"]
    return f" (call to first launch {1e3 * first:.0f} ms, last end to return {1e3 * last:.0f} ms)"


def settle(gang_client: Any, static_clients: list[Any]) -> None:
    """Every cluster's spare rank processes ready (as on a user's idle cluster), so a side never
    starts while the side before it puts spares back (8 imports of torch on 2 cores, the static
    clusters' included)."""
    from clusterkit.runners.ddp.driver import wait_ready

    wait_ready(gang_client, timeout=180)
    for (_, size), client in zip(GROUPS, static_clients, strict=True):
        if size > 1:
            wait_ready(client, timeout=180)


def simulated(side: str, trials: list[tuple[int, float]]) -> float | None:
    """The side's policy with zero overhead, in seconds; None for a side that is not gangs."""
    policy = next((p for p in POLICIES if side.startswith(f"gangs, {p} ")), None)
    return None if policy is None else zero_overhead_makespan(trials, SLOTS, SLOTS, policy)


def report(args: Any, results: dict[str, Any], bounds: list[float], ideals: list[float]) -> None:
    sizes = [k for k, _ in draw(args.trials, args.seed)]
    print()
    print(
        f"{args.trials} trials (k=1: {sizes.count(1)}, k=2: {sizes.count(2)}, "
        f"k=4: {sizes.count(4)} in rep 0), t ~ U(0.5, 3) s, {SLOTS} slots, {args.reps} reps "
        f"(medians); static partition with zero overhead (computed) median "
        f"{statistics.median(ideals):.2f}s"
    )
    print(
        "| side | makespan s | makespan / lower bound | zero overhead (simulated) / lower bound "
        "| utilisation | launch -> rank 0 start ms (median / p95) "
        "| slots held beyond t ms (median / p95) | call to first launch / last end to return ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(f"| lower bound | {statistics.median(bounds):.2f} | 1.000 | 1.000 | 1.000 | | | |")
    for name, runs in results.items():
        makespan = statistics.median(r["makespan"] for r in runs)
        ratio = statistics.median(r["makespan"] / r["bound"] for r in runs)
        util = statistics.median(r["work"] / (SLOTS * r["makespan"]) for r in runs)
        launch = [x for r in runs for x in r["launch"]]
        held = [x for r in runs for x in r["held"]]
        sim = [r["simulated"] / r["bound"] for r in runs if r["simulated"] is not None]
        verdict = ""
        if name.startswith("gangs"):
            verdict = f" (target <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'})"
        print(
            f"| {name} | {makespan:.2f} | {ratio:.3f}{verdict} "
            f"| {f'{statistics.median(sim):.3f}' if sim else ''} | {util:.3f} "
            f"| {1e3 * statistics.median(launch):.0f} / {1e3 * percentile(launch, 95):.0f} "
            f"| {1e3 * statistics.median(held):.0f} / {1e3 * percentile(held, 95):.0f} "
            f"| {_edges_median(runs)} |"
        )
    print(
        "\nlaunch/held columns: gang trials only (static: its k=2 and k=4 searches; its k=1 "
        "searches are plain searches with no rank processes)."
    )


def _edges_median(runs: list[dict[str, Any]]) -> str:
    edges = [r["edges"] for r in runs if "edges" in r]
    if not edges:
        return ""
    first, last = (1e3 * statistics.median(e[i] for e in edges) for i in (0, 1))
    return f"{first:.0f} / {last:.0f}"


def simulate_only(args: Any) -> None:
    """``--simulate``: each policy with zero overhead over seeds, no cluster started."""
    print(f"| seed | lower bound s | {' | '.join(f'{p} / lower bound' for p in POLICIES)} |")
    print("|---|---|" + "---|" * len(POLICIES))
    ratios: dict[str, list[float]] = {p: [] for p in POLICIES}
    for rep in range(args.reps):
        trials = draw(args.trials, args.seed + rep)
        bound = lower_bound(trials)
        for policy in POLICIES:
            ratios[policy].append(zero_overhead_makespan(trials, SLOTS, SLOTS, policy) / bound)
        row = " | ".join(f"{ratios[p][-1]:.3f}" for p in POLICIES)
        print(f"| {args.seed + rep} | {bound:.2f} | {row} |")
    row = " | ".join(f"{statistics.median(ratios[p]):.3f}" for p in POLICIES)
    print(f"| median | | {row} |")


if __name__ == "__main__":
    main()
