"""`clusterkit up` of an ssh profile vs a raw distributed SSHCluster of the same shape.

One run, against a private sshd on 127.0.0.1 (generated keys, as in the tests), repetitions
interleaved with the order alternated. Each side is timed from the call to "all workers
connected and one task ran"; the clusterkit side goes through `api.up` (detached supervisor,
records, readiness) and `get_client`, the baseline is `SSHCluster(...)` + `Client`; a third
column times the ssh backend's `create_cluster` in-process, to split backend and lifecycle cost.
Prints per-repetition times, medians and the ratio (target <= 1.2).

    .venv/bin/python bench/ssh_up.py [--reps 5] [--hosts 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import sshd as S


def raw(lab: dict, hosts: list[str]) -> float:
    from distributed import Client
    from distributed.deploy.ssh import SSHCluster

    started = time.perf_counter()
    cluster = SSHCluster(
        [hosts[0], *hosts],
        connect_options={
            "port": lab["port"],
            "username": "root",
            "client_keys": [lab["key"]],
            "known_hosts": lab["known_hosts"],
        },
        worker_options={"nthreads": 1, "n_workers": 1, "host": "127.0.0.1"},
        scheduler_options={"port": 0, "host": "127.0.0.1", "dashboard": False},
        remote_python=sys.executable,
    )
    with Client(cluster) as client:
        client.wait_for_workers(len(hosts))
        assert client.submit(sum, [1, 2]).result() == 3
        elapsed = time.perf_counter() - started
    cluster.close()
    return elapsed


def clusterkit_up(lab: dict, hosts: list[str]) -> float:
    from clusterkit import api
    from clusterkit.client import get_client
    from clusterkit.schema import SSHProfile

    name = f"bench-ssh-{uuid.uuid4().hex[:6]}"
    profile = SSHProfile.model_validate(
        {
            "backend": "ssh",
            "hosts": hosts,
            "port": lab["port"],
            "user": "root",
            "identity_files": [lab["key"]],
            "known_hosts": lab["known_hosts"],
            "remote_python": sys.executable,
            "scheduler": {"dashboard": False},
        }
    ).named(name)
    started = time.perf_counter()
    api.up(profile)
    try:
        with get_client(name) as client:
            assert client.submit(sum, [1, 2]).result() == 3
            elapsed = time.perf_counter() - started
    finally:
        api.down(name)
    return elapsed


def backend_only(lab: dict, hosts: list[str]) -> float:
    """The ssh backend's create_cluster in this process: its cost without the supervisor."""
    from distributed import Client

    from clusterkit.backends.ssh import backend as ssh
    from clusterkit.schema import SSHProfile
    from clusterkit.security import ClusterSecurity

    profile = SSHProfile.model_validate(
        {
            "backend": "ssh",
            "hosts": hosts,
            "port": lab["port"],
            "user": "root",
            "identity_files": [lab["key"]],
            "known_hosts": lab["known_hosts"],
            "remote_python": sys.executable,
            "scheduler": {"dashboard": False},
        }
    ).named("bench-backend")
    started = time.perf_counter()
    cluster = ssh.SSHBackend().create(profile, ClusterSecurity(), name="bench")
    with Client(cluster) as client:
        client.wait_for_workers(len(hosts))
        assert client.submit(sum, [1, 2]).result() == 3
        elapsed = time.perf_counter() - started
    cluster.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hosts", type=int, default=2, help="worker host entries")
    args = parser.parse_args()
    reason = S.missing_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    with tempfile.TemporaryDirectory() as scratch:
        os.environ.setdefault("CLUSTERKIT_STATE_DIR", f"{scratch}/state")
        keys = S.Keys.generate(Path(scratch) / "keys")
        server = S.start_sshd(keys, "bench")
        try:
            known = S.write_known_hosts(Path(scratch) / "known_hosts", keys, [server])
            lab = {"port": server.port, "key": str(keys.client_key), "known_hosts": str(known)}
            hosts = ["127.0.0.1"] * args.hosts
            times: dict[str, list[float]] = {
                "raw SSHCluster": [],
                "clusterkit up": [],
                "backend only": [],
            }
            for rep in range(args.reps):
                order = [
                    ("raw SSHCluster", raw),
                    ("clusterkit up", clusterkit_up),
                    ("backend only", backend_only),
                ]
                for label, fn in order if rep % 2 == 0 else reversed(order):
                    times[label].append(fn(lab, hosts))
                print(
                    f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                    flush=True,
                )
        finally:
            server.stop()
    base = statistics.median(times["raw SSHCluster"])
    ours = statistics.median(times["clusterkit up"])
    ratios = [o / b for o, b in zip(times["clusterkit up"], times["raw SSHCluster"], strict=True)]
    print(
        f"median raw SSHCluster {base:.2f}s, clusterkit up {ours:.2f}s, "
        f"ratio {ours / base:.2f} (per-rep median {statistics.median(ratios):.2f}, "
        f"target <= 1.2), {args.hosts} workers, {args.reps} reps"
    )


if __name__ == "__main__":
    main()
