"""HPO dispatch benchmark: clusterkit runner vs the seed skopt batch loop vs an as-completed loop.

Every method evaluates 60 trials of a 4-D Branin objective that sleeps a duration drawn per trial
number from a lognormal (mean 0.5 s, sigma 1.0, capped at 4 s; seeded per repetition), on the
same LocalCluster of W single-thread workers, interleaved per repetition. Reported per method:
makespan / ideal (greedy list scheduling of the same durations in trial order, zero overhead),
utilisation (sum of durations / (W x makespan)) and driver time per trial.

    .venv/bin/python bench/hpo.py --workers 2 4 --reps 3 --skopt-reps 1

At scale (RandomSampler, clusterkit in-memory and journal storage beside the hand-written
as-completed loop, wall and driver ms per trial): ``--zero 250 1000 2500 10000`` (zero-length
trials, 2 single-thread workers); ``--slots 5000 4 64`` (256 slots, trials sleeping lognormal,
mean 2 s, sigma 1, cap 20 s: makespan over the ideal asynchronous schedule, clusterkit then
the hand loop on the same cluster).

Cold start (issue #27): ``--cold 40 0.3 --reps 5``: each repetition starts a fresh LocalCluster
of 2 single-thread workers (not timed), then times ``hpo.run`` from call to return on an
objective imported from a small project directory (``workdir="auto"``: the project is handed
to the workers, whose first trial imports the objective's module and optuna) against the ideal
``n x t / slots``; utilisation = busy time (the trials' start-to-end on the workers) / (slots x
makespan). ``--no-warm`` turns the runner's worker warm-up off (the baseline); ``--cold-ab``
runs both, alternating per repetition (``--reference``: and a third side whose workers ran a
search before, untimed: what a cold search should match). ``--lookahead-ab``: and a side with
``lookahead=0`` (each trial dispatched only when a slot frees: the runner before it queued
trials ahead).
"""

from __future__ import annotations

import argparse
import heapq
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

N_TRIALS = 60
#: The clusters' protocol: "tls" is clusterkit's default (its own CA and keys, made per run),
#: set by --protocol; the hand loops run on the same cluster.
PROTOCOL = {"name": "tls"}


def local_cluster(workers: int, threads: int = 1) -> Any:
    """A LocalCluster on loopback under the chosen protocol, no dashboard."""
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=workers,
        threads_per_worker=threads,
        host="127.0.0.1",
        dashboard_address=None,
        **cluster_security(),
    )


def cluster_security() -> dict[str, Any]:
    """LocalCluster keywords for the chosen protocol (mutual TLS as clusterkit sets it up)."""
    if PROTOCOL["name"] != "tls":
        return {"protocol": "tcp://"}
    import tempfile
    from pathlib import Path

    from clusterkit.security import generate_tls

    security = generate_tls(Path(tempfile.mkdtemp(prefix="bench-tls-")))
    return {"protocol": "tls://", "security": security.distributed()}


BOUNDS = [(-5.0, 10.0), (0.0, 15.0), (-5.0, 10.0), (0.0, 15.0)]


def durations(seed: int, n: int = N_TRIALS) -> list[float]:
    """Lognormal with mean 0.5 s and sigma 1.0, capped at 4 s."""
    rng = np.random.default_rng(seed)
    mu = math.log(0.5) - 0.5  # mean of a lognormal is exp(mu + sigma^2 / 2)
    return [min(4.0, float(d)) for d in rng.lognormal(mu, 1.0, n)]


def branin4(x: list[float]) -> float:
    """Sum of two 2-D Branin functions: minimum 0.795 (2 x 0.397887)."""

    def branin(a: float, b: float) -> float:
        c1, c2, c3 = 5.1 / (4 * math.pi**2), 5 / math.pi, 1 / (8 * math.pi)
        return (b - c1 * a * a + c2 * a - 6) ** 2 + 10 * (1 - c3) * math.cos(a) + 10

    return branin(x[0], x[1]) + branin(x[2], x[3])


def evaluate(x: list[float], seconds: float) -> float:
    time.sleep(seconds)
    return branin4(x)


def ideal_makespan(times: list[float], workers: int) -> float:
    """Greedy list scheduling in trial order with zero overhead."""
    free = [0.0] * workers
    for t in times:
        heapq.heapreplace(free, free[0] + t)
    return max(free)


# ------------------------------------------------------------------ the three methods


def run_clusterkit(
    client: Any,
    times: list[float],
    seed: int,
    storage: str,
    lookahead: int = 1,
    presample: bool = True,
) -> tuple[float, float]:
    import optuna

    from clusterkit.runners import hpo
    from clusterkit.runners.hpo import driver as hpo_driver
    from clusterkit.runners.hpo import presample as drawing_ahead

    drawing_ahead.ENABLED = presample

    def objective(trial: optuna.Trial) -> float:
        x = [trial.suggest_float(f"x{i}", lo, hi) for i, (lo, hi) in enumerate(BOUNDS)]
        return evaluate(x, times[trial.number])

    store: Any = optuna.storages.InMemoryStorage()
    if storage == "journal":
        import tempfile

        store = tempfile.mkdtemp(prefix="hpo-bench-") + "/study.optuna.log"
    started = time.perf_counter()
    hpo.run(
        objective,
        n_trials=N_TRIALS,
        client=client,
        storage=store,
        study_name="bench",
        sampler=optuna.samplers.TPESampler(seed=seed),
        progress=False,
        workdir=None,  # as the other methods: no project to ship
        lookahead=lookahead,
    )
    makespan = time.perf_counter() - started
    drawing_ahead.ENABLED = True
    return makespan, hpo_driver.LAST_RUN_STATS["overhead_s"] / N_TRIALS


def run_as_completed(client: Any, times: list[float], seed: int) -> tuple[float, float]:
    """The hand-written loop a careful user writes: ask on the driver, submit, tell as done."""
    import optuna
    from distributed import as_completed

    dists = {
        f"x{i}": optuna.distributions.FloatDistribution(lo, hi) for i, (lo, hi) in enumerate(BOUNDS)
    }
    workers = sum(w["nthreads"] for w in client.scheduler_info()["workers"].values())
    started = time.perf_counter()
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    overhead = 0.0

    def submit() -> Any:
        trial = study.ask(dists)
        x = [trial.params[f"x{i}"] for i in range(4)]
        future = client.submit(evaluate, x, times[trial.number], pure=False)
        future.number = trial.number
        return future

    pending = as_completed([submit() for _ in range(workers)])
    asked = workers
    for future in pending:
        began = time.perf_counter()
        study.tell(future.number, future.result())
        if asked < N_TRIALS:
            pending.add(submit())
            asked += 1
        overhead += time.perf_counter() - began
    return time.perf_counter() - started, overhead / N_TRIALS


def run_skopt_batches(client: Any, times: list[float], seed: int) -> tuple[float, float]:
    """The seed notebook's loop: ask(n_points=W), evaluate the batch, tell, repeat."""
    from skopt import Optimizer

    workers = sum(w["nthreads"] for w in client.scheduler_info()["workers"].values())
    started = time.perf_counter()
    optimizer = Optimizer(dimensions=BOUNDS, random_state=seed)
    overhead = 0.0
    done = 0
    while done < N_TRIALS:
        began = time.perf_counter()
        batch = optimizer.ask(n_points=min(workers, N_TRIALS - done))
        overhead += time.perf_counter() - began
        futures = [
            client.submit(evaluate, list(map(float, x)), times[done + i], pure=False)
            for i, x in enumerate(batch)
        ]
        values = client.gather(futures)
        began = time.perf_counter()
        optimizer.tell(batch, values)
        overhead += time.perf_counter() - began
        done += len(batch)
    return time.perf_counter() - started, overhead / N_TRIALS


# ------------------------------------------------------- scale: zero-length trials, 256 slots


def zero_objective(trial: Any) -> float:
    return trial.suggest_float("x", 0.0, 1.0)


def sleep_objective_for(times: list[float]) -> Callable[[Any], float]:
    def objective(trial: Any) -> float:
        x = trial.suggest_float("x", 0.0, 1.0)
        time.sleep(times[trial.number])
        return x

    return objective


def scale_clusterkit(
    client: Any, objective: Any, n: int, storage: str, lookahead: int = 1
) -> tuple[float, float]:
    """Wall seconds and driver seconds per trial of clusterkit with RandomSampler."""
    import tempfile

    import optuna

    from clusterkit.runners import hpo
    from clusterkit.runners.hpo import driver as hpo_driver

    store: Any = optuna.storages.InMemoryStorage()
    if storage == "journal":
        store = tempfile.mkdtemp(prefix="hpo-bench-") + "/study.optuna.log"
    started = time.perf_counter()
    hpo.run(
        objective,
        n_trials=n,
        client=client,
        storage=store,
        study_name="scale",
        sampler=optuna.samplers.RandomSampler(seed=0),
        progress=False,
        workdir=None,  # as the hand loop: no project to ship (auto would pick this checkout)
        lookahead=lookahead,
    )
    wall = time.perf_counter() - started
    return wall / n, hpo_driver.LAST_RUN_STATS["overhead_s"] / n


def scale_hand_loop(client: Any, objective: Any, n: int) -> tuple[float, float]:
    """The hand-written as-completed loop: ask on the driver, run the objective on a worker
    with the fixed parameters (a FixedTrial), tell as each finishes."""
    import optuna
    from distributed import as_completed

    dists = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    slots = sum(w["nthreads"] for w in client.scheduler_info()["workers"].values())
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    started, overhead = time.perf_counter(), 0.0

    def run_fixed(params: dict[str, float], number: int) -> float:
        return objective(optuna.trial.FixedTrial(params, number))

    def submit() -> Any:
        trial = study.ask(dists)
        future = client.submit(run_fixed, trial.params, trial.number, pure=False)
        future.number = trial.number
        return future

    pending = as_completed([submit() for _ in range(min(slots, n))])
    asked = min(slots, n)
    for future in pending:
        began = time.perf_counter()
        study.tell(future.number, future.result())
        if asked < n:
            pending.add(submit())
            asked += 1
        overhead += time.perf_counter() - began
    wall = time.perf_counter() - started
    return wall / n, overhead / n


def bench_zero(sizes: list[int]) -> None:
    """Zero-length trials on 2 single-thread workers, side by side per N."""
    from distributed import Client

    with (
        local_cluster(2) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        client.run(__import__, "clusterkit.runners.hpo.worker")
        scale_clusterkit(client, zero_objective, 20, "memory")  # warm both paths
        scale_hand_loop(client, zero_objective, 20)
        print(
            "| N | clusterkit in-memory ms/trial (driver) | clusterkit journal ms/trial (driver) "
            "| hand loop ms/trial (driver) | clusterkit journal / hand |"
        )
        print("|---|---|---|---|---|")
        for n in sizes:
            mem = scale_clusterkit(client, zero_objective, n, "memory")
            jour = scale_clusterkit(client, zero_objective, n, "journal")
            hand = scale_hand_loop(client, zero_objective, n)
            print(
                f"| {n} | {1e3 * mem[0]:.2f} ({1e3 * mem[1]:.2f}) | {1e3 * jour[0]:.2f} "
                f"({1e3 * jour[1]:.2f}) | {1e3 * hand[0]:.2f} ({1e3 * hand[1]:.2f}) "
                f"| {jour[0] / hand[0]:.2f} |",
                flush=True,
            )


def lognormal_times(n: int, mean: float, cap: float, seed: int = 7) -> list[float]:
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - 0.5
    return [min(cap, float(d)) for d in rng.lognormal(mu, 1.0, n)]


def old_window(log: Any, slots: int) -> None:
    """The change log's window before issue 27 (2 x slots + 64 entries), for --window-ab."""
    log.window = 2 * slots + 64


def bench_slots(
    n: int,
    workers: int,
    threads: int,
    storage: str,
    window_ab: bool = False,
    ahead_ab: bool = False,
) -> None:
    """Many slots: sleeping lognormal trials (mean 2 s, sigma 1, cap 20 s), makespan / ideal.
    ``window_ab``: also clusterkit with the change log's old window, ``ahead_ab``: with
    ``lookahead=0``, in the same run."""
    from distributed import Client

    from clusterkit.runners.hpo.changelog import ChangeLog

    times = lognormal_times(n, 2.0, 20.0)
    slots = workers * threads
    ideal = ideal_makespan(times, slots)
    with (
        local_cluster(workers, threads) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(workers)
        client.run(__import__, "clusterkit.runners.hpo.worker")
        objective = sleep_objective_for(times)
        sides = {
            "clusterkit": scale_clusterkit(client, objective, n, storage),
            "hand loop": scale_hand_loop(client, objective, n),
        }
        if ahead_ab:
            sides["clusterkit, lookahead 0"] = scale_clusterkit(client, objective, n, storage, 0)
        if window_ab:
            resize = ChangeLog.resize
            ChangeLog.resize = old_window  # type: ignore[method-assign]
            try:
                sides["clusterkit, old window"] = scale_clusterkit(client, objective, n, storage)
            finally:
                ChangeLog.resize = resize  # type: ignore[method-assign]
    print("| slots | trials | side | makespan s | ideal s | ratio | driver ms/trial |")
    print("|---|---|---|---|---|---|---|")
    for side, (per_trial, driver) in sides.items():
        makespan = per_trial * n
        print(
            f"| {slots} | {n} | {side} ({storage}) | {makespan:.1f} | {ideal:.1f} "
            f"| {makespan / ideal:.3f} | {1e3 * driver:.2f} |",
            flush=True,
        )


# ------------------------------------------------------------------ cold start (fresh workers)

COLD_MODULE = """import time

import numpy  # noqa: F401  (a typical objective's imports)
import optuna
{imports}
SECONDS = {seconds!r}


def objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -10.0, 10.0)
    time.sleep(SECONDS)
    return (x - 2.0) ** 2
"""


COLD_IMPORTS: list[str] = []  # --cold-imports: what else the objective's module imports

SIDES = {
    "warm-up": "cold workers, warm-up on",
    "no-warm": "cold workers, no warm-up (baseline)",
    "warmed-cluster": "warm workers (a search ran before; reference)",
    "lookahead-0": "cold workers, warm-up on, lookahead 0 (before)",
}


def cold_once(n: int, seconds: float, side: str) -> tuple[float, float]:
    """One fresh 2-worker cluster; (makespan / ideal, utilisation) of ``hpo.run`` on it.
    ``warmed-cluster``: a 4-trial search runs first, untimed (what a cold search should match)."""
    import importlib
    import os
    import sys
    import tempfile

    from distributed import Client

    from clusterkit.runners import hpo
    from clusterkit.runners.hpo import inputs, warmup

    top = tempfile.mkdtemp(prefix="hpo-cold-")
    project = os.path.join(top, "project")
    os.makedirs(project)
    with open(os.path.join(project, "cold_objective.py"), "w") as handle:
        imports = "".join(f"import {name}  # noqa: F401\n" for name in COLD_IMPORTS)
        handle.write(COLD_MODULE.format(seconds=seconds, imports=imports))
    here = os.getcwd()
    os.chdir(project)
    sys.path.insert(0, project)
    sys.modules.pop("cold_objective", None)
    module = importlib.import_module("cold_objective")
    warmup.ENABLED = side != "no-warm"
    options = {"client": None, "progress": False, "study_name": "cold"}
    try:
        with (
            local_cluster(2) as cluster,
            Client(cluster) as client,
        ):
            client.wait_for_workers(2)
            options["client"] = client
            if side == "warmed-cluster":
                hpo.run(module.objective, n_trials=4, storage=os.path.join(top, "w.log"), **options)
            started = time.perf_counter()
            study = hpo.run(
                module.objective,
                n_trials=n,
                storage=os.path.join(top, "s.log"),
                lookahead=0 if side == "lookahead-0" else 1,
                **options,
            )
            makespan = time.perf_counter() - started
    finally:
        warmup.ENABLED = True
        os.chdir(here)
        sys.path.remove(project)
    busy = 0.0
    for trial in study.get_trials(deepcopy=False):
        begin, end = trial.user_attrs[inputs.ATTR_TIME]
        busy += end - begin
    return makespan / (n * seconds / 2), busy / (2 * makespan)


def bench_cold(n: int, seconds: float, reps: int, sides: list[str]) -> None:
    """``reps`` searches per side, the sides' order rotating per repetition."""
    found: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for rep in range(reps):
        shift = rep % len(sides)
        for side in sides[shift:] + sides[:shift]:
            ratio, util = cold_once(n, seconds, side)
            found[side].append((ratio, util))
            print(f"rep={rep} {side}: ratio {ratio:.3f} utilisation {util:.3f}", flush=True)
    print("\n| side | reps | makespan / ideal, median [min-max] | utilisation, median [min-max] |")
    print("|---|---|---|---|")
    for side, values in found.items():
        ratios, utils = zip(*values, strict=True)
        print(
            f"| {SIDES[side]} | {len(values)} "
            f"| {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
            f"| {statistics.median(utils):.3f} [{min(utils):.3f}-{max(utils):.3f}] |"
        )


# ------------------------------------------------------------------ driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the async methods")
    parser.add_argument("--skopt-reps", type=int, default=1, help="repetitions of skopt (slow)")
    parser.add_argument("--zero", type=int, nargs="*", help="zero-length trial counts to run")
    parser.add_argument("--slots", type=int, nargs="*", help="TRIALS WORKERS THREADS")
    parser.add_argument("--window-ab", action="store_true", help="--slots: and the old window")
    parser.add_argument("--storage", default="journal", choices=["journal", "memory"])
    parser.add_argument(
        "--protocol", default="tls", choices=["tls", "tcp"], help="tls: clusterkit's default"
    )
    parser.add_argument("--cold", type=float, nargs="*", help="TRIALS SECONDS (40 0.3)")
    parser.add_argument("--no-warm", action="store_true", help="--cold without the warm-up")
    parser.add_argument("--cold-ab", action="store_true", help="--cold with and without it")
    parser.add_argument(
        "--lookahead-ab", action="store_true", help="--cold, --slots: and lookahead=0 (before)"
    )
    parser.add_argument("--reference", action="store_true", help="--cold-ab: and warm workers")
    parser.add_argument(
        "--cold-imports", nargs="*", default=[], help="--cold: modules the objective imports"
    )
    args = parser.parse_args()
    PROTOCOL["name"] = args.protocol
    logging.getLogger("distributed").setLevel(logging.ERROR)
    if args.cold is not None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        n, seconds = (int(args.cold[0]), args.cold[1]) if args.cold else (40, 0.3)
        COLD_IMPORTS[:] = args.cold_imports
        sides = (
            ["warm-up", "no-warm"] if args.cold_ab else ["no-warm" if args.no_warm else "warm-up"]
        )
        sides += ["warmed-cluster"] if args.cold_ab and args.reference else []
        sides += ["lookahead-0"] if args.lookahead_ab else []
        bench_cold(n, seconds, args.reps, sides)
        return
    if args.zero or args.slots:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if args.zero:
            bench_zero(args.zero)
        if args.slots:
            bench_slots(
                *args.slots,
                storage=args.storage,
                window_ab=args.window_ab,
                ahead_ab=args.lookahead_ab,
            )
        return

    import optuna
    from distributed import Client

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    methods: dict[str, Callable[..., tuple[float, float]]] = {
        "clusterkit (in-memory)": lambda c, t, s: run_clusterkit(c, t, s, "memory"),
        "clusterkit (journal file)": lambda c, t, s: run_clusterkit(c, t, s, "journal"),
        "clusterkit (in-memory, lookahead 0)": lambda c, t, s: run_clusterkit(
            c, t, s, "memory", lookahead=0
        ),
        "clusterkit (in-memory, queued trials sample on their worker: before)": (
            lambda c, t, s: run_clusterkit(c, t, s, "memory", presample=False)
        ),
        "as-completed Optuna loop": run_as_completed,
        "skopt ask(n_points=W) batches": run_skopt_batches,
    }
    rows = []
    for workers in args.workers:
        results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
        cluster = local_cluster(workers)
        client = Client(cluster)
        try:
            client.wait_for_workers(workers)
            client.submit(evaluate, [0.0] * 4, 0.0).result()  # warm the workers
            # The runner's worker side imports optuna once per worker process: a one-off cost
            # that is not dispatch overhead, paid here so that repetition 0 is comparable.
            client.run(__import__, "clusterkit.runners.hpo.worker")
            for rep in range(args.reps):
                times = durations(seed=1000 + rep)
                ideal = ideal_makespan(times, workers)
                for name, method in methods.items():
                    if name.startswith("skopt") and rep >= args.skopt_reps:
                        continue
                    makespan, overhead = method(client, times, rep)
                    results[name].append(
                        (makespan / ideal, sum(times) / (workers * makespan), overhead)
                    )
                    print(
                        f"W={workers} rep={rep} {name}: makespan {makespan:.2f}s "
                        f"ideal {ideal:.2f}s ratio {makespan / ideal:.3f} "
                        f"utilisation {sum(times) / (workers * makespan):.3f} "
                        f"driver {1000 * overhead:.1f} ms/trial",
                        flush=True,
                    )
        finally:
            client.close()
            try:
                cluster.close(timeout=30)
            except Exception as error:  # a slow nanny at teardown must not lose the results
                print(f"warning: closing the W={workers} cluster: {error!r}", flush=True)
        for name, values in results.items():
            if not values:
                continue
            ratios, utils, overheads = zip(*values, strict=True)
            rows.append(
                (
                    workers,
                    name,
                    len(values),
                    statistics.mean(ratios),
                    (statistics.stdev(ratios) if len(ratios) > 1 else 0.0),
                    statistics.mean(utils),
                    1000 * statistics.mean(overheads),
                )
            )
    print()
    print("| W | method | reps | makespan / ideal | utilisation | driver ms / trial |")
    print("|---|---|---|---|---|---|")
    for w, name, reps, ratio, sd, util, ms in rows:
        print(f"| {w} | {name} | {reps} | {ratio:.3f} ± {sd:.3f} | {util:.3f} | {ms:.1f} |")


if __name__ == "__main__":
    main()
