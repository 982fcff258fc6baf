"""Lifecycle overhead of clusterkit against raw distributed, side by side, interleaved, repeated.

(a) `clusterkit up local` (the CLI in a fresh process, until it returns: the workers joined)
    vs a raw LocalCluster of the same shape in a fresh interpreter (until its workers joined);
    a third column starts the raw LocalCluster in this process (no interpreter start, no
    imports: a reference, not the target's baseline)
(b) get_client("NAME") from a fresh process  vs  Client(address) from a fresh process
(c) embedded get_client() in a fresh process  vs  LocalCluster + Client in a fresh process
(d) 1000 tiny tasks on the clusterkit cluster  vs  on the raw one (throughput ratio)

Under the secure default: clusterkit's `local` profile runs mutual TLS with a fresh CA per
cluster, and the raw sides use the same TLS (one CA and certificates made before the timing
starts, passed as a plain ``distributed.Security``), so each ratio is what clusterkit adds.
A reference side for (a) and (c) is distributed's own per-cluster TLS, ``security=True``
(``Security.temporary()``: a fresh key and certificate made at every start, as clusterkit's).

Targets (issue 27): (a) <= 1.1x, (b) <= 1.05x, (c) <= 1.05x, (d) >= 0.95x.
`clusterkit --help` against bare Python and a minimal typer app: bench/cli.py.
Run: .venv/bin/python bench/lifecycle.py [--reps 5] [--before DIR]

``--before DIR`` (an older checkout: ``git worktree add DIR REV``) adds its clusterkit to
(a), (b) and (c) as further sides, on PYTHONPATH: before and after, side by side in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _side_by_side as B

PY = sys.executable
WORKERS = 2
# the same shape as the bundled `local` profile (`clusterkit profiles render local`):
# 2 workers x 1 thread, memory auto, loopback, dashboard on a free loopback port, processes
SHAPE = dict(
    n_workers=WORKERS,
    threads_per_worker=1,
    memory_limit="auto",
    death_timeout=60.0,
    host="127.0.0.1",
    scheduler_port=0,
    dashboard_address="127.0.0.1:0",
    protocol="tls://",
    processes=True,
)
#: the raw scripts' TLS: ``SECURITY`` (a distributed.Security) from RAW_TLS's files
RAW_TLS: dict[str, str] = {}
SECURITY = (
    "from distributed import Security\nsecurity = Security(require_encryption=True, **{tls!r})\n"
)
RAW_FRESH = (
    "import sys\nfrom distributed import LocalCluster\n{security}"
    f"N_WORKERS = {WORKERS}\ncluster = LocalCluster(**{SHAPE!r}, security=security)\n"
    f"{B.WAIT_AND_HOLD}"
)
#: distributed's own per-cluster TLS: a fresh key and self-signed certificate at every start
TEMPORARY = "security = True\n"
RAW_CLUSTER = """
import sys
from distributed import LocalCluster
{security}
if __name__ == "__main__":
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                           dashboard_address="127.0.0.1:0", processes=True,
                           protocol="tls://", security=security)
    print(cluster.scheduler_address, flush=True)
    sys.stdin.read()
    cluster.close()
"""

RAW_ATTACH = (
    "import sys\nfrom distributed import Client\n{security}"
    "Client(sys.argv[1], security=security).close()"
)
CK_ATTACH = "import sys, clusterkit; clusterkit.get_client(sys.argv[1]).close()"
RAW_EMBEDDED = """
from distributed import Client, LocalCluster
{security}
if __name__ == "__main__":
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                           dashboard_address="127.0.0.1:0", protocol="tls://", security=security)
    client = Client(cluster)  # the cluster's own Security (with security=True, a fresh one)
    client.close(); cluster.close()
"""


def raw_tls(directory: Path) -> None:
    """One CA and the scheduler's, workers' and client's certificates for the raw sides, made
    with clusterkit's own generator (untimed: a raw user has them already)."""
    from clusterkit.security import ROLE_FILES, generate_tls

    made = generate_tls(directory, ["127.0.0.1"])
    RAW_TLS["tls_ca_file"] = str(made.ca_file)
    for role in ROLE_FILES:
        RAW_TLS[f"tls_{role}_cert"], RAW_TLS[f"tls_{role}_key"] = map(str, made.pair(role))


def with_tls(script: str, *, temporary: bool = False) -> str:
    """A raw script with the TLS lines in place of ``{security}``: RAW_TLS's files, or
    (``temporary``) distributed's own per-cluster TLS."""
    lines = TEMPORARY if temporary else SECURITY.format(tls=RAW_TLS)
    return script.replace("{security}", lines)


def raw_security() -> object:
    from distributed import Security

    return Security(require_encryption=True, **RAW_TLS)


CK_EMBEDDED = textwrap.dedent("""
    import clusterkit
    if __name__ == "__main__":
        clusterkit.get_client("local").close()
""")


def up_cli(env: dict[str, str]) -> float:
    """(a) `clusterkit up local` as users run it; `clusterkit down local` afterwards."""
    try:
        return B.run_cli("up", "local", env=env)
    finally:
        B.run_cli("down", "local", env=env)


def up_raw_fresh(env: dict[str, str]) -> float:
    return B.run_fresh(with_tls(RAW_FRESH), env=env)


def up_raw_temporary(env: dict[str, str]) -> float:
    return B.run_fresh(with_tls(RAW_FRESH, temporary=True), env=env)


def up_raw_inprocess() -> float:
    from distributed import LocalCluster

    started = time.perf_counter()
    cluster = LocalCluster(**SHAPE, security=raw_security())  # type: ignore[arg-type]
    try:
        B.wait_workers(cluster, WORKERS)
        return time.perf_counter() - started
    finally:
        cluster.close()


def timed(command: list[str], **kwargs: object) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, **kwargs)  # type: ignore[call-overload]
    return time.perf_counter() - start


def start_raw() -> tuple[subprocess.Popen[str], str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [PY, "-c", with_tls(RAW_CLUSTER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    return proc, address, time.perf_counter() - start


def stop_raw(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=60)


def tiny_tasks(name_or_address: str, n: int = 1000) -> float:
    """Seconds for n tiny tasks, measured in this process on an attached client."""
    from distributed import Client

    import clusterkit

    client = (
        clusterkit.get_client(name_or_address)
        if "://" not in name_or_address
        else Client(name_or_address, security=raw_security(), set_as_default=False)
    )
    with client:
        client.gather(client.map(lambda x: x + 1, range(50), pure=False))  # warm up
        start = time.perf_counter()
        client.gather(client.map(lambda x: x + 1, range(n), pure=False))
        return time.perf_counter() - start


def before_env(env: dict[str, str], before: str | None) -> dict[str, str] | None:
    """The environment that runs the older checkout ``before`` (compiled, as ours is)."""
    if before is None:
        return None
    import compileall
    import tomllib

    compileall.compile_dir(str(Path(before) / "clusterkit"), quiet=1)
    scripts = tomllib.loads((Path(before) / "pyproject.toml").read_text())["project"]["scripts"]
    # PYTHONSAFEPATH: `python -c` would put the working directory (this checkout) first
    old = {"PYTHONPATH": before, "PYTHONSAFEPATH": "1", B.ENTRY_VAR: scripts["clusterkit"]}
    return {**env, **old}


def one_round(env: dict[str, str], old: dict[str, str] | None) -> dict[str, float]:
    """(b), (c), (d): a clusterkit cluster and a raw one up side by side (starts untimed);
    with ``old`` (the older checkout's environment), its attach and embedded start too."""
    ratios: dict[str, float] = {}
    B.run_cli("up", "local", env=env)
    raw, address, _ = start_raw()
    try:
        # (b): attach from a fresh process
        ck_attach = timed([PY, "-c", CK_ATTACH, "local"], env=env)
        raw_attach = timed([PY, "-c", with_tls(RAW_ATTACH), address], env=env)
        ratios["b"] = ck_attach / raw_attach
        if old is not None:
            ratios["b_before"] = timed([PY, "-c", CK_ATTACH, "local"], env=old) / raw_attach
        # (d): throughput ratio (raw time / clusterkit time: >1 means clusterkit is faster)
        raw_tasks = tiny_tasks(address)
        ck_tasks = tiny_tasks("local")
        ratios["d"] = raw_tasks / ck_tasks
    finally:
        stop_raw(raw)
        B.run_cli("down", "local", env=env)
    # (c): embedded, each in a fresh process
    raw_embedded = timed([PY, "-c", with_tls(RAW_EMBEDDED)], env=env)
    ck_embedded = timed([PY, "-c", CK_EMBEDDED], env=env)
    temporary = timed([PY, "-c", with_tls(RAW_EMBEDDED, temporary=True)], env=env)
    ratios["c"] = ck_embedded / raw_embedded
    ratios["c_temporary"] = ck_embedded / temporary
    if old is not None:
        ratios["c_before"] = timed([PY, "-c", CK_EMBEDDED], env=old) / raw_embedded
    ratios.update(
        ck_attach=ck_attach,
        raw_attach=raw_attach,
        ck_embedded=ck_embedded,
        raw_embedded=raw_embedded,
        temporary_embedded=temporary,
    )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only-up", action="store_true", help="(a) only")
    parser.add_argument("--before", metavar="DIR", help="an older checkout, run beside")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        env = B.bench_env(CLUSTERKIT_STATE_DIR=state)
        raw_tls(Path(state) / "raw-tls")
        os.environ.update(env)  # (d) attaches by name from this process
        old = before_env(env, args.before)
        print(f"(a) up until ready, {WORKERS} workers x 1 thread; load {B.load()}")
        sides = [
            B.Side("clusterkit up local (CLI)", lambda: up_cli(env)),
            B.Side("raw LocalCluster, fresh python", lambda: up_raw_fresh(env)),
            B.Side("raw LocalCluster, in-process", up_raw_inprocess),
            B.Side("raw, security=True, fresh python", lambda: up_raw_temporary(env)),
        ]
        if old is not None:
            sides.append(B.Side("clusterkit up local, before", lambda: up_cli(old)))
        up = B.interleave(sides, args.reps)
        B.table(
            up,
            "clusterkit up local (CLI)",
            "raw LocalCluster, fresh python",
            1.1,
            {
                "raw LocalCluster, in-process": "no interpreter start or imports: reference only",
                "raw, security=True, fresh python": "distributed's per-cluster TLS: reference",
            },
        )
        if args.only_up:
            return
        rounds = []
        for _ in range(args.reps):
            rounds.append(one_round(env, old))
            B.reap(env[B.TOKEN_VAR])
    targets = {"b": ("<=", 1.05), "c": ("<=", 1.05), "d": (">=", 0.95)}
    labels = {
        "b": "get_client(NAME) fresh process / raw Client(address)",
        "c": "embedded get_client() / raw LocalCluster + Client",
        "c_temporary": "embedded get_client() / raw with security=True",
        "d": "1000 tiny tasks throughput: clusterkit / raw",
    }
    if old is not None:
        targets.update(b_before=("<=", 1.05), c_before=("<=", 1.05))
        labels.update(
            b_before="get_client(NAME), the checkout before",
            c_before="embedded get_client(), the checkout before",
        )
    print(f"\n{'measure':69}{'median':>8}{'min':>7}{'max':>7}  target")
    for key, label in labels.items():
        values = [r[key] for r in rounds]
        median = statistics.median(values)
        verdict = "reference"
        if key in targets:
            op, bound = targets[key]
            met = median <= bound if op == "<=" else median >= bound
            verdict = f"{op} {bound} {'met' if met else 'MISSED'}"
        spread = f"{median:8.2f}{min(values):7.2f}{max(values):7.2f}"
        print(f"{'(' + key + ')':15}{label:54}{spread}  {verdict}")
    print(
        "\nabsolute medians (s): "
        + ", ".join(
            f"{k} {statistics.median(r[k] for r in rounds):.2f}"
            for k in (
                "ck_attach",
                "raw_attach",
                "ck_embedded",
                "raw_embedded",
                "temporary_embedded",
            )
        )
    )


if __name__ == "__main__":
    main()
