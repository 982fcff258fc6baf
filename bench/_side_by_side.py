"""What the `up` benches share: timing a fresh process, the interleaved and order-alternating
repetition loop, leftover checks, and the median / [min-max] / ratio table.

Each bench (lifecycle.py, ssh_up.py, slurm_up.py) names its sides as ``Side(label, run)``:
``run()`` starts a cluster, returns the seconds until it was ready, and tears it down again
(teardown is not timed). ``interleave`` runs every side once per repetition, forwards on even
repetitions and backwards on odd ones, so drift in the machine's load hits every side alike,
and checks after each side that nothing it started is left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
#: the `clusterkit` console script of this interpreter's environment: what users type
CLUSTERKIT = str(Path(PY).with_name("clusterkit"))
#: set (``module:function``) where the environment runs another checkout: that checkout's
#: console-script entry point, run as the script pip writes for it would run it
ENTRY_VAR = "CLUSTERKIT_BENCH_ENTRY"
#: every process a bench starts carries this variable (value: one token per run)
TOKEN_VAR = "CLUSTERKIT_BENCH_TOKEN"
READY = "ready"

#: the raw baseline script's tail: wait for the workers the way `up` does (the cluster's
#: scheduler_info, no Client), print, then close once the bench writes a line to stdin
WAIT_AND_HOLD = """
import time
while len(cluster.scheduler_info.get("workers", {})) < N_WORKERS:
    time.sleep(0.1)
print("ready", cluster.scheduler_address, flush=True)
sys.stdin.readline()  # the timer stopped; close on request
cluster.close()
"""


def wait_workers(cluster: object, n: int, timeout: float = 120.0) -> None:
    """In-process: block until ``n`` workers joined (as `up`'s start path polls)."""
    deadline = time.monotonic() + timeout
    while len(cluster.scheduler_info.get("workers", {})) < n:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} workers after {timeout}s")
        time.sleep(0.1)


def bench_env(**extra: str) -> dict[str, str]:
    """This process's environment plus a run token (set here too, for in-process sides).

    In-process sides log at WARNING (distributed.deploy.ssh relays every remote INFO line)."""
    import logging

    import distributed  # noqa: F401 - its logging setup first, then ours over it

    logging.getLogger("distributed").setLevel(logging.WARNING)
    compile_clusterkit()
    token = os.environ.get(TOKEN_VAR) or uuid.uuid4().hex
    os.environ[TOKEN_VAR] = token
    env = {**os.environ, **extra}
    env.pop("CLUSTERKIT_PROFILE", None)
    return env


def compile_clusterkit() -> None:
    """Bytecode for clusterkit, as an installed package has: with PYTHONDONTWRITEBYTECODE set
    (as in some CI shells) every fresh process would otherwise compile its modules from
    source, a cost the raw side (distributed, installed with its bytecode) does not pay."""
    import compileall

    import clusterkit

    compileall.compile_dir(Path(clusterkit.__file__).parent, quiet=1)


def run_cli(*args: str, env: dict[str, str], timeout: float = 300.0) -> float:
    """Seconds a `clusterkit ...` command takes in a fresh process (until it exits)."""
    command = [CLUSTERKIT, *args]
    if env.get(ENTRY_VAR):
        module, function = env[ENTRY_VAR].split(":")
        script = f"import sys; from {module} import {function} as f; sys.exit(f())"
        command = [PY, "-c", script, *args]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"clusterkit {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return elapsed


def run_fresh(script: str, *args: str, env: dict[str, str], timeout: float = 300.0) -> float:
    """Seconds from starting ``python -c script`` until it prints 'ready' (a fresh interpreter
    that pays Python's start and its imports); then it is told to close and waited for."""
    errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed below
    started = time.perf_counter()
    child = subprocess.Popen(
        [PY, "-c", script, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    try:
        line = child.stdout.readline()
        elapsed = time.perf_counter() - started
        if not line.startswith(READY):
            code = child.wait(timeout)
            errors.seek(0)
            tail = errors.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"raw script did not get ready (exit {code}):\n{tail}")
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=timeout)
    finally:
        errors.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    return elapsed


def leftovers(token: str) -> dict[int, str]:
    """Live processes, other than this one, that carry the run token: pid -> command line."""
    import psutil

    found: dict[int, str] = {}
    for process in psutil.process_iter(["pid", "ppid", "status", "cmdline"]):
        if process.info["pid"] == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        command = " ".join(process.info["cmdline"] or [])
        if process.info["ppid"] == os.getpid() and "multiprocessing.resource_tracker" in command:
            continue  # this process's own helper (an in-process side started it); ends with us
        try:
            environ = process.environ()
        except (psutil.Error, OSError):
            continue
        if environ.get(TOKEN_VAR) == token:
            found[process.info["pid"]] = command[:160]
    return found


def reap(token: str, seconds: float = 20.0) -> dict[int, str]:
    """Wait until nothing carrying ``token`` runs; SIGKILL and return what is left after that."""
    deadline = time.monotonic() + seconds
    while True:
        left = leftovers(token)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


@dataclass
class Side:
    label: str
    run: Callable[[], float]


def interleave(
    sides: list[Side],
    reps: int,
    check: Callable[[str], Iterable[str]] | None = None,
) -> dict[str, list[float]]:
    """Run every side once per repetition, order alternating; seconds per side.

    After each side, ``check(label)`` (default: no process carrying the run token is left)
    returns problems; they are printed, and counted into the report.
    """
    token = os.environ[TOKEN_VAR]
    times: dict[str, list[float]] = {side.label: [] for side in sides}
    for rep in range(reps):
        for side in sides if rep % 2 == 0 else list(reversed(sides)):
            times[side.label].append(side.run())
            problems = list(check(side.label)) if check else []
            problems += [f"left running: {pid} {cmd}" for pid, cmd in reap(token).items()]
            for problem in problems:
                LEFTOVERS.append(f"rep {rep} {side.label}: {problem}")
                print(f"  ! rep {rep} {side.label}: {problem}", flush=True)
        print(
            f"rep {rep} (load {load()}): "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
            flush=True,
        )
    return times


LEFTOVERS: list[str] = []


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(
    times: dict[str, list[float]],
    ours: str,
    base: str,
    target: float,
    notes: dict[str, str] | None = None,
) -> bool:
    """Print medians [min-max] per side and the ratios to ``base``; whether ``ours`` met it."""
    notes = notes or {}
    reps = len(times[base])
    print(f"\n{reps} reps; load average now {load()}; {os.cpu_count()} cores")
    print(f"{'side':34}{'median':>8}{'min':>7}{'max':>7}   ratio to '{base}' [min-max per rep]")
    met = True
    for label, values in times.items():
        ratios = [v / b for v, b in zip(values, times[base], strict=True)]
        ratio = statistics.median(values) / statistics.median(times[base])
        verdict = ""
        if label == ours:
            met = ratio <= target
            verdict = f"  target <= {target}: {'met' if met else 'MISSED'}"
        print(
            f"{label:34}{statistics.median(values):8.2f}{min(values):7.2f}{max(values):7.2f}"
            f"   {ratio:5.2f} [{min(ratios):.2f}-{max(ratios):.2f}]{verdict}"
            + (f"  ({notes[label]})" if label in notes else "")
        )
    if LEFTOVERS:
        print(f"{len(LEFTOVERS)} leftover problems (see '!' lines above)")
    return met


def backend_only(profile_path: str, workers: int) -> float:
    """The profile's backend ``create`` in this process until ``workers`` joined, then its
    ``destroy``: clusterkit's backend cost without the CLI, the supervisor or the record."""
    from clusterkit.backends.base import backend_for
    from clusterkit.profiles import load_profile
    from clusterkit.security import ClusterSecurity

    profile = load_profile(profile_path)
    backend = backend_for(profile)
    started = time.perf_counter()
    cluster = backend.create(profile, ClusterSecurity(), name=f"bench-{uuid.uuid4().hex[:6]}")
    try:
        wait_workers(cluster, workers)
        return time.perf_counter() - started
    finally:
        backend.destroy(cluster, profile)
