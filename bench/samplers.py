"""Sampler-quality benchmark (issue #50): does running a sampler through clusterkit cost quality?

For each built-in Optuna sampler and test function, the best value found after N trials over S
seeds (seed i = repetition i, passed as the sampler's ``seed=``), on three sides run in one
process on the same machine, interleaved per seed:

``optuna``
    ``study.optimize`` on an ``InMemoryStorage``, one thread: the reference.
``ck-1``
    clusterkit's ``hpo.run`` on a LocalCluster of 1 worker x 1 thread, ``lookahead=0``: one
    trial at a time, as ``optimize`` runs them (deterministic samplers should match exactly).
``ck-K``
    ``hpo.run`` on K slots (``--slots 4``: 2 workers x 2 threads), the default lookahead.
``optuna-K`` (``--optuna-jobs``, off by default)
    ``study.optimize(n_jobs=K)``, Optuna's own threads: what K trials at once cost a sampler
    without clusterkit, the fair reference for ``ck-K`` (CMA-ES, GP and the constant liar all
    learn less per trial when K trials are in flight).

Reported per sampler and function: each side's median best (best value - the function's known
optimum, so 0 is perfect) and its range over seeds [min-max]. The verdict flags a side "worse"
when its median is worse (higher) than the serial run's *worst* seed, i.e. outside the serial
run's own spread. By chance alone (both sides from one distribution) that happens when the 3
worst of the 10 values (5 seeds a side) are all the other side's: 10/120, ~8% of rows per side,
so at 5 seeds one flag is a hint and a column of them a finding (``--seeds`` narrows it). The
verdict also names, per side, the trials whose parameters an earlier trial of the same run
already had ("repeated points": a sampler state lost between workers draws a point again).
"sys attrs kept" counts, summed over seeds, the trials of a side that carry at least one of the
system attributes the sampler writes under ``study.optimize`` (the key families seen on the
serial side's trials, chunk suffixes ``:0``, ``:1``... stripped: ``cma:generation`` and
``cma:optimizer`` for CMA-ES, ``NSGAIISampler:generation``, ``tpe:relative_params`` for the
constant liar...) against the serial side's count: ``400/400`` is every trial; ``0/400`` means
the sampler's state was lost on the way back from the workers (CMA-ES then restarts every
generation, NSGA-II never leaves its first generation). "-": the sampler writes no trial system
attributes (Random, QMC, TPE without the constant liar). On ``ck-K`` the first wave (K x (1 +
lookahead) trials, 8 at 4 slots) starts before any trial completed, so samplers that learn the
search space from completed trials (CMA-ES, TPE, GP) sample it independently, writing nothing,
as under Optuna's own ``n_jobs``: 360/395 is CMA-ES's full count at 80 trials x 5 seeds.
"ck-1 = optuna": the seeds whose ck-1 run evaluated exactly the serial run's values, in order
(every sampler here is deterministic given its seed).

    .venv/bin/python bench/samplers.py                      # 9 samplers x sphere, rosenbrock
    .venv/bin/python bench/samplers.py --trials 20 --seeds 2 --samplers RandomSampler CmaEsSampler
    .venv/bin/python bench/samplers.py --functions rastrigin branin --json /tmp/samplers.json
    .venv/bin/python bench/samplers.py --samplers CmaEsSampler QMCSampler --optuna-jobs

Samplers (``--samplers``, by these names): RandomSampler, TPESampler (Optuna's defaults: in
Optuna 5 multivariate and the constant liar, single-objective), TPESampler-multivariate
(``multivariate=True, constant_liar=False``), TPESampler-constant_liar (``multivariate=False,
constant_liar=True``), CmaEsSampler, GPSampler, NSGAIISampler, NSGAIIISampler, QMCSampler
(``scramble=True``, else every seed draws the same sequence). GPSampler is slow (a Gaussian
process fitted per trial, on torch): it runs ``min(--trials, 30)`` trials and ``min(--seeds, 3)``
seeds, which keeps the full default run under ~10 minutes on a 2-core machine. GridSampler,
BruteForceSampler and PartialFixedSampler are left out: they enumerate or pin a search space,
their "best after N trials" says nothing about a sampler's quality.

Functions (``--functions``, minimised, pure numpy): sphere 4-D on [-5,5]^4 (optimum 0),
rosenbrock 4-D on [-2,2]^4 (0 at x=1), rastrigin 4-D on [-5.12,5.12]^4 (0 at x=0), branin 2-D on
[-5,10]x[0,15] (0.397887). Default: sphere and rosenbrock.

The clusters: LocalCluster, ``processes=True`` (the objective pickled by value to worker
processes, as a user's would be), host 127.0.0.1, plain TCP (not the TLS the other benches use:
the trials take microseconds and quality, not transport, is measured here), no dashboard; one
per slot count, made once and reused across samplers, functions and seeds. Each run gets a fresh
``InMemoryStorage`` and its own study name; ``workdir=None`` (no project shipped),
``progress=False``. ``--json PATH`` also writes every run's best value, wall time and attribute
counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import bench/

# ------------------------------------------------------------------ the test functions


def sphere(x: np.ndarray) -> float:
    return float(np.sum(x * x))


def rosenbrock(x: np.ndarray) -> float:
    return float(np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2))


def rastrigin(x: np.ndarray) -> float:
    return float(10.0 * len(x) + np.sum(x * x - 10.0 * np.cos(2.0 * math.pi * x)))


def branin(x: np.ndarray) -> float:
    a, b = float(x[0]), float(x[1])
    c1, c2, c3 = 5.1 / (4 * math.pi**2), 5 / math.pi, 1 / (8 * math.pi)
    return (b - c1 * a * a + c2 * a - 6) ** 2 + 10 * (1 - c3) * math.cos(a) + 10


#: name -> (function, bounds per dimension, known minimum)
FUNCTIONS: dict[str, tuple[Callable[[np.ndarray], float], list[tuple[float, float]], float]] = {
    "sphere": (sphere, [(-5.0, 5.0)] * 4, 0.0),
    "rosenbrock": (rosenbrock, [(-2.0, 2.0)] * 4, 0.0),
    "rastrigin": (rastrigin, [(-5.12, 5.12)] * 4, 0.0),
    "branin": (branin, [(-5.0, 10.0), (0.0, 15.0)], 0.397887357729738),
}


class Objective:
    """An Optuna objective for one test function (module level: pickled by value to workers)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, trial: Any) -> float:
        function, bounds, _ = FUNCTIONS[self.name]
        x = np.array([trial.suggest_float(f"x{i}", lo, hi) for i, (lo, hi) in enumerate(bounds)])
        return function(x)


# ------------------------------------------------------------------ the samplers


def _samplers() -> dict[str, Callable[[int], Any]]:
    import optuna

    s = optuna.samplers
    return {
        "RandomSampler": lambda seed: s.RandomSampler(seed=seed),
        "TPESampler": lambda seed: s.TPESampler(seed=seed),
        "TPESampler-multivariate": lambda seed: s.TPESampler(
            seed=seed, multivariate=True, constant_liar=False
        ),
        "TPESampler-constant_liar": lambda seed: s.TPESampler(
            seed=seed, multivariate=False, constant_liar=True
        ),
        "CmaEsSampler": lambda seed: s.CmaEsSampler(seed=seed),
        "GPSampler": lambda seed: s.GPSampler(seed=seed),
        "NSGAIISampler": lambda seed: s.NSGAIISampler(seed=seed),
        "NSGAIIISampler": lambda seed: s.NSGAIIISampler(seed=seed),
        "QMCSampler": lambda seed: s.QMCSampler(seed=seed, scramble=True),
    }


SAMPLER_NAMES = [
    "RandomSampler",
    "TPESampler",
    "TPESampler-multivariate",
    "TPESampler-constant_liar",
    "CmaEsSampler",
    "GPSampler",
    "NSGAIISampler",
    "NSGAIIISampler",
    "QMCSampler",
]
#: Slow samplers: at most this many (trials, seeds).
CAPS = {"GPSampler": (30, 3)}


def budget(sampler: str, trials: int, seeds: int) -> tuple[int, int]:
    cap_trials, cap_seeds = CAPS.get(sampler, (trials, seeds))
    return min(trials, cap_trials), min(seeds, cap_seeds)


# ------------------------------------------------------------------ one run per side


def attr_family(key: str) -> str:
    """A system attribute's key less its chunk suffix: ``cma:optimizer:3`` -> ``cma:optimizer``."""
    return re.sub(r"(:\d+)+$", "", key)


def families(study: Any) -> dict[int, set[str]]:
    """Each finished trial's system-attribute families, by trial number."""
    return {
        t.number: {attr_family(k) for k in t.system_attrs}
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished()
    }


def run_side(
    side: str, sampler_name: str, function: str, seed: int, trials: int, client: Any, jobs: int
) -> dict[str, Any]:
    import optuna

    from clusterkit.runners import hpo

    sampler = _samplers()[sampler_name](seed)
    storage = optuna.storages.InMemoryStorage()
    name = f"{sampler_name}-{function}-{side}-{seed}-{uuid.uuid4().hex[:8]}"
    objective = Objective(function)
    started = time.perf_counter()
    if side.startswith("optuna"):  # optuna: one thread; optuna-K: Optuna's own n_jobs=K
        study = optuna.create_study(
            storage=storage, study_name=name, sampler=sampler, direction="minimize"
        )
        study.optimize(objective, n_trials=trials, n_jobs=jobs)
    else:
        study = hpo.run(
            objective,
            n_trials=trials,
            client=client,
            storage=storage,
            study_name=name,
            direction="minimize",
            sampler=sampler,
            progress=False,
            workdir=None,
            **({"lookahead": 0} if side == "ck-1" else {}),
        )
    wall = time.perf_counter() - started
    complete = [t for t in study.get_trials(deepcopy=False) if t.value is not None]
    return {
        "side": side,
        "sampler": sampler_name,
        "function": function,
        "seed": seed,
        "trials": trials,
        "completed": len(complete),
        "best": min(t.value for t in complete) - FUNCTIONS[function][2],
        "values": [t.value for t in sorted(complete, key=lambda t: t.number)],
        # trials whose parameters an earlier trial already had (a sampler state lost between
        # workers draws the same point again: QMC's sample counter, a seeded RNG copied)
        "repeats": len(complete) - len({tuple(sorted(t.params.items())) for t in complete}),
        "wall_s": wall,
        "attr_families": {str(n): sorted(f) for n, f in families(study).items()},
    }


def carrying(run: dict[str, Any], wanted: set[str]) -> int:
    """How many of a run's trials carry at least one of the wanted attribute families."""
    return sum(1 for fams in run["attr_families"].values() if wanted & set(fams))


# ------------------------------------------------------------------ the table


def fmt(x: float) -> str:
    return f"{x:.3g}"


def summary(runs: list[dict[str, Any]]) -> tuple[float, float, float]:
    bests = [r["best"] for r in runs]
    return statistics.median(bests), min(bests), max(bests)


def same_as_serial(serial: list[dict[str, Any]], other: list[dict[str, Any]]) -> int:
    """How many seeds' runs evaluated exactly the serial run's values, in the same order."""
    values = {r["seed"]: r["values"] for r in serial}
    return sum(1 for r in other if r["values"] == values.get(r["seed"]))


def report(results: list[dict[str, Any]], sides: list[str]) -> list[dict[str, Any]]:
    """One row per (sampler, function): each side's median [min-max], the verdict, attrs kept."""
    rows = []
    keys = list(dict.fromkeys((r["sampler"], r["function"]) for r in results))
    for sampler, function in keys:
        by_side = {
            side: [
                r
                for r in results
                if (r["sampler"], r["function"], r["side"]) == (sampler, function, side)
            ]
            for side in sides
        }
        stats = {side: summary(runs) for side, runs in by_side.items() if runs}
        serial_worst = stats["optuna"][2]
        worse = [
            side
            for side in sides[1:]
            if side in stats and stats[side][0] > serial_worst + 1e-9 * max(1.0, abs(serial_worst))
        ]
        repeats = {
            side: sum(r["repeats"] for r in by_side[side]) for side in sides if by_side[side]
        }
        wanted: set[str] = set()
        for run in by_side["optuna"]:
            for fams in run["attr_families"].values():
                wanted |= set(fams)
        serial_count = sum(carrying(r, wanted) for r in by_side["optuna"])
        kept = {
            side: sum(carrying(r, wanted) for r in by_side[side]) if wanted else None
            for side in sides[1:]
        }
        rows.append(
            {
                "sampler": sampler,
                "function": function,
                "trials": by_side["optuna"][0]["trials"],
                "seeds": len(by_side["optuna"]),
                "stats": stats,
                "worse": worse,
                "families": sorted(wanted),
                "serial_attr_trials": serial_count,
                "kept": kept,
                "repeats": repeats,
                "same": same_as_serial(by_side["optuna"], by_side.get("ck-1", [])),
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], sides: list[str]) -> None:
    head = ["sampler", "function", "trials x seeds"]
    head += [f"{side} median [min-max]" for side in sides]
    head += ["verdict", f"sys attrs kept ({', '.join(sides[1:])})", "ck-1 = optuna"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        cells = [row["sampler"], row["function"], f"{row['trials']} x {row['seeds']}"]
        for side in sides:
            med, lo, hi = row["stats"][side]
            cells.append(f"{fmt(med)} [{fmt(lo)}-{fmt(hi)}]")
        verdict = [f"**{s} worse**" for s in row["worse"]]
        verdict += [f"{s}: {n} repeated points" for s, n in row["repeats"].items() if n]
        cells.append("; ".join(verdict) or "ok")
        if row["families"]:
            total = row["serial_attr_trials"]
            cells.append(", ".join(f"{row['kept'][s]}/{total}" for s in sides[1:]))
        else:
            cells.append("-")
        cells.append(f"{row['same']}/{row['seeds']}")
        print("| " + " | ".join(cells) + " |")


# ------------------------------------------------------------------ main


def local_cluster(workers: int, threads: int) -> Any:
    """A LocalCluster of worker processes on loopback, plain TCP, no dashboard."""
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=workers,
        threads_per_worker=threads,
        processes=True,
        host="127.0.0.1",
        protocol="tcp://",
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )


def slot_shape(slots: int) -> tuple[int, int]:
    """K slots as workers x threads: 2 x K/2 when K is even (4: 2 x 2), else K x 1."""
    return (2, slots // 2) if slots % 2 == 0 and slots > 2 else (slots, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=80, help="trials per run (GPSampler: <=30)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per side (GPSampler: <=3)")
    parser.add_argument("--samplers", nargs="+", default=SAMPLER_NAMES, choices=SAMPLER_NAMES)
    parser.add_argument(
        "--functions", nargs="+", default=["sphere", "rosenbrock"], choices=list(FUNCTIONS)
    )
    parser.add_argument("--slots", type=int, default=4, help="the ck-K side's slots")
    parser.add_argument(
        "--optuna-jobs",
        action="store_true",
        help="and a side optuna-K: study.optimize(n_jobs=K), Optuna's own threads (~+2 min)",
    )
    parser.add_argument("--json", help="also write every run's raw results here")
    args = parser.parse_args()

    import optuna
    from distributed import Client

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    # The schedulers' HTTP routes (health, metrics) start even without a dashboard, on 8787 if
    # free, else any port: harmless here.
    warnings.filterwarnings("ignore", message="Port 8787 is already in use")

    began = time.perf_counter()
    k_side = f"ck-{args.slots}"
    sides = ["optuna", "ck-1", k_side] + ([f"optuna-{args.slots}"] if args.optuna_jobs else [])
    jobs = {side: args.slots if side == f"optuna-{args.slots}" else 1 for side in sides}
    workers, threads = slot_shape(args.slots)
    with (
        local_cluster(1, 1) as one,
        Client(one) as client_1,
        local_cluster(workers, threads) as many,
        Client(many) as client_k,
    ):
        client_1.wait_for_workers(1)
        client_k.wait_for_workers(workers)
        clients = {"ck-1": client_1, k_side: client_k}
        print(
            f"optuna {optuna.__version__}; ck-1: 1 worker x 1 thread, lookahead=0; {k_side}: "
            f"{workers} workers x {threads} threads, default lookahead; LocalCluster processes, "
            f"tcp on 127.0.0.1",
            flush=True,
        )
        results: list[dict[str, Any]] = []
        for sampler in args.samplers:
            trials, seeds = budget(sampler, args.trials, args.seeds)
            for function in args.functions:
                started = time.perf_counter()
                for seed in range(seeds):
                    for side in sides:  # interleaved per seed
                        results.append(
                            run_side(
                                side, sampler, function, seed, trials, clients.get(side), jobs[side]
                            )
                        )
                walls = {
                    side: sum(
                        r["wall_s"]
                        for r in results
                        if (r["sampler"], r["function"], r["side"]) == (sampler, function, side)
                    )
                    for side in sides
                }
                print(
                    f"  {sampler} {function}: {trials} trials x {seeds} seeds in "
                    f"{time.perf_counter() - started:.1f} s ("
                    + ", ".join(f"{s} {w:.1f} s" for s, w in walls.items())
                    + ")",
                    file=sys.stderr,
                    flush=True,
                )

    rows = report(results, sides)
    print()
    print_table(rows, sides)
    print()
    print(
        "Best value - known optimum (lower is better), median [min-max] over seeds. Verdict: a "
        "side is worse when its median is above the optuna side's worst seed (by chance alone: "
        "~8% of rows per side at 5 seeds); repeated points: trials re-evaluating an earlier "
        "trial's parameters. Sys attrs kept: trials (all seeds) carrying the sampler's system "
        "attributes, that side / the optuna side ('-': the sampler writes none); on "
        f"{k_side} the first wave ({args.slots} slots x (1 + lookahead)) starts before any "
        "trial completed, so samplers that learn the search space from completed trials sample "
        "it independently, without attributes, as Optuna's own n_jobs would. ck-1 = optuna: "
        "seeds whose ck-1 run evaluated exactly the serial run's values."
    )
    print(f"Total wall time: {time.perf_counter() - began:.1f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "args": vars(args),
                    "sides": sides,
                    "runs": results,
                    "rows": [
                        {**r, "stats": {k: list(v) for k, v in r["stats"].items()}} for r in rows
                    ],
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
