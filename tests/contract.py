"""The one contract every backend passes: up -> get_client (fresh process) -> submit -> scale ->
logs -> runners -> down -> nothing left behind. Backend test modules call ``run_contract``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from clusterkit import api, state
from clusterkit.client import get_client

FRESH_PROCESS = textwrap.dedent("""
    import sys, clusterkit
    client = clusterkit.get_client(sys.argv[1])
    print(client.submit(sum, [20, 22]).result(timeout=60))
    client.close()
""")


def fresh_process_result(name: str, env: dict[str, str] | None = None) -> str:
    """Run get_client(NAME) + one task in a brand-new Python process; return its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, name],
        capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def run_contract(
    profile: Any,
    *,
    name: str | None = None,
    scale_to: int | None = None,
    workloads: tuple[Callable[[Any], None], ...] = (),
    env: dict[str, str] | None = None,
) -> state.ClusterRecord:
    """Bring the profile up and take it through every verb; returns the (gone) record."""
    record = api.up(profile, name=name)
    name = record.name
    try:
        assert state.read_record(name) is not None
        assert any(row["name"] == name for row in api.list_clusters())
        assert fresh_process_result(name, env) == "42"
        client = get_client(name)
        try:
            assert client.submit(lambda x: x * 2, 21).result(timeout=60) == 42
            if scale_to is not None:
                api.scale(name, scale_to)
                assert len(api.scheduler_identity(client)["workers"]) == scale_to
            info = api.status(name)
            assert info["address"] == record.address and info["workers"]
            assert "scheduler" in api.logs(name)
            for workload in workloads:
                workload(client)
        finally:
            client.close()
    finally:
        api.down(name)
    assert state.read_record(name) is None, "down left the record behind"
    assert not state.pid_alive(record.pid), "down left the supervisor running"
    return record
