"""What mutual TLS (the default protocol) costs against explicit `protocol: tcp`, side by side.

`local` backend, the bundled profile's shape (2 workers x 1 thread, loopback), once with the
default protocol (mutual TLS: a fresh CA and three keys per cluster) and once with
`protocol: tcp`; sides interleaved with alternating order, medians of --reps:

(a) `clusterkit up PROFILE` until it returns (the CLI in a fresh process: workers joined)
(b) get_client(NAME) from a fresh process, until it is connected (then closed)
(c) 2,000 tiny tasks: client.map of a trivial function and gather, from this process
(d) 200 MB moved between two workers: a numpy array made on worker A, then a task pinned to
    worker B that depends on it (timed from B's task's submission to its result)

The table's ratio is tls time / tcp time (above 1: TLS is slower).
Run: .venv/bin/python bench/security.py [--reps 3] [--explicit-tls]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _side_by_side as B

PY = sys.executable
WORKERS = 2
TASKS = 2_000
MOVED_BYTES = 200 * 10**6
PROTOCOLS = ("tls", "tcp")
SHAPE = """\
backend: local
workers: 2
worker: {threads: 1, memory: auto}
scheduler: {host: 127.0.0.1, port: 0, dashboard: true}
start_timeout: 60s
"""
ATTACH = "import sys, clusterkit; clusterkit.get_client(sys.argv[1]).close()"


def write_profiles(directory: Path, explicit_tls: bool) -> dict[str, Path]:
    """sec-tls.yaml (the default protocol, or `protocol: tls`) and sec-tcp.yaml."""
    lines = {"tls": "protocol: tls\n" if explicit_tls else "", "tcp": "protocol: tcp\n"}
    paths = {}
    for protocol, line in lines.items():
        paths[protocol] = directory / f"sec-{protocol}.yaml"
        paths[protocol].write_text(SHAPE + line)
    return paths


def scheme_of(name: str) -> str:
    from clusterkit import state

    record = state.read_record(name)
    if record is None:
        raise RuntimeError(f"no record for '{name}' after `clusterkit up`")
    return record.address.split("://", 1)[0]


def up_cli(profile: Path, protocol: str, env: dict[str, str]) -> float:
    """(a) `clusterkit up PROFILE` as users run it (checking the scheme it got); `down` after."""
    name = profile.stem
    try:
        seconds = B.run_cli("up", str(profile), env=env)
        if scheme_of(name) != protocol:
            raise RuntimeError(f"'{name}' came up as {scheme_of(name)}://, not {protocol}://")
        return seconds
    finally:
        B.run_cli("down", name, env=env)


def attach(name: str, env: dict[str, str]) -> float:
    """(b) get_client(NAME) in a fresh interpreter, until it exits."""
    started = time.perf_counter()
    subprocess.run([PY, "-c", ATTACH, name], env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def inc(x: int) -> int:
    return x + 1


def tiny_tasks(client: Any) -> float:
    """(c) Seconds for TASKS trivial tasks, after a small warm-up."""
    client.gather(client.map(inc, range(50), pure=False))
    started = time.perf_counter()
    client.gather(client.map(inc, range(TASKS), pure=False))
    return time.perf_counter() - started


def make_array(nbytes: int) -> Any:
    import numpy as np

    return np.ones(nbytes // 8, dtype=np.float64)


def size_of(array: Any) -> int:
    return int(array.nbytes)


def transfer(client: Any) -> float:
    """(d) Seconds for B's task to get A's MOVED_BYTES array and finish."""
    from distributed import wait

    a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])[:2]
    made = client.submit(make_array, MOVED_BYTES, workers=[a], allow_other_workers=False,
                         pure=False)
    with client.as_current():  # get_client's client is not the default one
        wait(made, timeout=120)
    started = time.perf_counter()
    moved = client.submit(size_of, made, workers=[b], allow_other_workers=False, pure=False)
    if moved.result(timeout=300) != MOVED_BYTES:
        raise RuntimeError("the array arrived with the wrong size")
    seconds = time.perf_counter() - started
    holders = client.who_has(made)[made.key]
    if b not in holders:
        raise RuntimeError(f"worker B never held the array (holders: {holders})")
    del made, moved
    return seconds


def one_round(profiles: dict[str, Path], env: dict[str, str], rep: int) -> dict[str, float]:
    """(b), (c), (d) on both clusters, up side by side (their starts untimed)."""
    import clusterkit

    for protocol in PROTOCOLS:
        B.run_cli("up", str(profiles[protocol]), env=env)
    order = PROTOCOLS if rep % 2 == 0 else tuple(reversed(PROTOCOLS))
    times: dict[str, float] = {}
    try:
        for protocol in order:
            times[f"b {protocol}"] = attach(profiles[protocol].stem, env)
        for protocol in order:
            with clusterkit.get_client(profiles[protocol].stem) as client:
                client.wait_for_workers(WORKERS, timeout=60)
                times[f"c {protocol}"] = tiny_tasks(client)
                times[f"d {protocol}"] = transfer(client)
    finally:
        for protocol in PROTOCOLS:
            B.run_cli("down", profiles[protocol].stem, env=env)
    return times


def markdown(rows: list[tuple[str, list[float], list[float], Callable[[float], str]]]) -> None:
    """| measure | tls | tcp | tls/tcp |, medians, each cell with its rate where one applies."""
    print("\n| measure | tls (median [min-max]) | tcp (median [min-max]) | tls/tcp |")
    print("|---|---:|---:|---:|")
    for label, tls, tcp, rate in rows:
        cells = []
        for values in (tls, tcp):
            median = statistics.median(values)
            cells.append(f"{median:.2f} s [{min(values):.2f}-{max(values):.2f}]{rate(median)}")
        ratio = statistics.median(tls) / statistics.median(tcp)
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--explicit-tls", action="store_true",
        help="write `protocol: tls` in the TLS profile instead of relying on the default",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        env = B.bench_env(CLUSTERKIT_STATE_DIR=str(Path(scratch) / "state"))
        os.environ.update(env)  # (c) and (d) attach by name from this process
        profiles = write_profiles(Path(scratch), args.explicit_tls)
        print(f"(a) up until ready, {WORKERS} workers x 1 thread; load {B.load()}")
        up = B.interleave(
            [B.Side(p, functools.partial(up_cli, profiles[p], p, env)) for p in PROTOCOLS],
            args.reps,
        )
        rounds = []
        for rep in range(args.reps):
            rounds.append(one_round(profiles, env, rep))
            left = B.reap(env[B.TOKEN_VAR])
            B.LEFTOVERS.extend(f"round {rep}: left running: {p} {cmd}" for p, cmd in left.items())
            print(f"round {rep} (load {B.load()}): "
                  + ", ".join(f"{k} {v:.2f}s" for k, v in rounds[-1].items()), flush=True)

    def column(key: str) -> list[float]:
        return [r[key] for r in rounds]

    tls_kind = "protocol: tls" if args.explicit_tls else "default protocol (mutual TLS)"
    print(f"\n{args.reps} reps; tls = {tls_kind}, tcp = `protocol: tcp`; load average now "
          f"{B.load()}; {os.cpu_count()} cores")
    markdown([
        ("(a) `clusterkit up` until ready", up["tls"], up["tcp"], lambda s: ""),
        ("(b) get_client(NAME), fresh process", column("b tls"), column("b tcp"), lambda s: ""),
        (f"(c) {TASKS:,} tiny tasks", column("c tls"), column("c tcp"),
         lambda s: f" ({TASKS / s:,.0f} tasks/s)"),
        (f"(d) {MOVED_BYTES // 10**6} MB worker A -> worker B", column("d tls"),
         column("d tcp"), lambda s: f" ({MOVED_BYTES / 10**6 / s:,.0f} MB/s)"),
    ])
    if B.LEFTOVERS:
        print(f"\n{len(B.LEFTOVERS)} leftover problems: " + "; ".join(B.LEFTOVERS))


if __name__ == "__main__":
    main()
