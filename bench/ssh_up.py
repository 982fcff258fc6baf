"""`clusterkit up` of an ssh profile vs a raw distributed SSHCluster of the same shape.

One run against a private sshd on 127.0.0.1 (generated keys, as in tests/sshd.py), repetitions
interleaved with the order alternated (bench/_side_by_side.py). Each side is timed until the
workers joined:
- clusterkit up (CLI): `clusterkit up PROFILE.yaml` in a fresh process, until it returns
  (the supervisor forked from it reports the workers joined); `clusterkit down` afterwards;
- raw SSHCluster, fresh python: the same shape (`clusterkit profiles render` of the profile)
  as a script in a new interpreter, until it prints; the target's baseline (<= 1.1);
- raw SSHCluster, in-process: in this process (no interpreter start, no imports): reference;
- backend only: the ssh backend's ``create`` in this process (no CLI, supervisor or record).
After each side no process started through the sshd may be left (polled, then killed).

    .venv/bin/python bench/ssh_up.py [--reps 5] [--hosts 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _side_by_side as B

from tests import sshd as S

NAME = "bench-ssh"


def shape(lab: dict, hosts: list[str]) -> dict:
    """SSHCluster keywords matching the profile below: loopback, 1 thread, no dashboard."""
    return {
        "hosts": [hosts[0], *hosts],  # the scheduler on the first host, then every worker host
        "connect_options": {
            "port": lab["port"],
            "username": "root",
            "client_keys": [lab["key"]],
            "known_hosts": lab["known_hosts"],
        },
        "worker_options": {
            "n_workers": 1,
            "nthreads": 1,
            "memory_limit": "auto",
            "death_timeout": 60.0,
            "host": "127.0.0.1",
        },
        "scheduler_options": {
            "protocol": "tcp",
            "port": 0,
            "host": "127.0.0.1",
            "dashboard": False,
        },
        "remote_python": sys.executable,
    }


def profile_yaml(lab: dict, hosts: list[str]) -> str:
    return json.dumps(  # JSON is YAML
        {
            "backend": "ssh",
            "hosts": hosts,
            "port": lab["port"],
            "user": "root",
            "identity_files": [lab["key"]],
            "known_hosts": lab["known_hosts"],
            "remote_python": sys.executable,
            "workers_per_host": 1,
            "worker": {"threads": 1},
            "scheduler": {"host": "127.0.0.1", "dashboard": False},
            "start_timeout": "120s",
        },
        indent=1,
    )


RAW_FRESH = (
    """
import sys, json
from distributed.deploy.ssh import SSHCluster
N_WORKERS = int(sys.argv[2])
cluster = SSHCluster(**json.loads(sys.argv[1]))
"""
    + B.WAIT_AND_HOLD
)


def raw_inprocess(kwargs: dict, workers: int) -> float:
    from distributed.deploy.ssh import SSHCluster

    started = time.perf_counter()
    cluster = SSHCluster(**kwargs)
    try:
        B.wait_workers(cluster, workers)
        return time.perf_counter() - started
    finally:
        cluster.close()


def up_cli(path: str, env: dict[str, str]) -> float:
    try:
        return B.run_cli("up", path, "--name", NAME, env=env)
    finally:
        B.run_cli("down", NAME, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hosts", type=int, default=2, help="worker host entries (1 worker each)")
    args = parser.parse_args()
    reason = S.missing_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    with tempfile.TemporaryDirectory() as scratch:
        keys = S.Keys.generate(Path(scratch) / "keys")
        server = S.start_sshd(keys, "bench")  # before the token: sshd is not a leftover
        env = B.bench_env(CLUSTERKIT_STATE_DIR=f"{scratch}/state")
        try:
            known = S.write_known_hosts(Path(scratch) / "known_hosts", keys, [server])
            lab = {"port": server.port, "key": str(keys.client_key), "known_hosts": str(known)}
            hosts = ["127.0.0.1"] * args.hosts
            path = Path(scratch) / "ssh-bench.yaml"
            path.write_text(profile_yaml(lab, hosts))
            kwargs = shape(lab, hosts)

            def no_remote_left(_label: str) -> list[str]:
                left = S.wait_no_remote_processes([server])
                S.kill_all(left)
                return [f"left on the ssh host: {pid} {cmd}" for pid, cmd in left.items()]

            print(f"ssh up until {args.hosts} workers joined; load {B.load()}", flush=True)
            times = B.interleave(
                [
                    B.Side("clusterkit up (CLI)", lambda: up_cli(str(path), env)),
                    B.Side(
                        "raw SSHCluster, fresh python",
                        lambda: B.run_fresh(
                            RAW_FRESH, json.dumps(kwargs), str(args.hosts), env=env
                        ),
                    ),
                    B.Side("raw SSHCluster, in-process", lambda: raw_inprocess(kwargs, args.hosts)),
                    B.Side(
                        "backend only, in-process", lambda: B.backend_only(str(path), args.hosts)
                    ),
                ],
                args.reps,
                check=no_remote_left,
            )
        finally:
            server.stop()
    B.table(
        times,
        "clusterkit up (CLI)",
        "raw SSHCluster, fresh python",
        1.1,
        {
            "raw SSHCluster, in-process": "no interpreter start or imports: reference only",
            "backend only, in-process": "clusterkit's ssh backend create, no CLI/supervisor",
        },
    )


if __name__ == "__main__":
    main()
