"""An `sge` profile whose worker runs on an execution host in another network namespace
(tests/sge_node.py): the qmaster stays on this host, the worker job lands on ``gx1`` and reaches
the scheduler over the link the profile's ``interface`` names, never through loopback."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from clusterkit import api, state
from tests import sge as G
from tests import sge_node
from tests.contract import run_contract, runners
from tests.test_sge import profile_file

pytestmark = pytest.mark.sge


def test_a_worker_on_an_execution_host_in_another_namespace(sge: G.SGE, tmp_path: Path) -> None:
    with sge_node.node(sge) as gx1:
        path = profile_file(
            tmp_path, "gx", queue=gx1.queue, interface=gx1.interface, workers=1, start_timeout=120
        )

        def runs_on_the_node(client: Any) -> None:
            (name,) = [r.name for r in state.records() if r.backend == "sge"]
            record = state.read_record(name)
            assert record is not None
            assert record.address.startswith(f"tls://{G.HOST_ADDRESS}:"), record.address
            hosts = client.run(socket.gethostname)
            assert set(hosts.values()) == {gx1.name}, hosts
            assert all(f"//{gx1.address}:" in address for address in hosts), hosts
            rows = [r for r in api.status(name)["rows"] if r["kind"] == "job"]
            assert rows and all(gx1.name in str(r) for r in rows), rows
            assert gx1.processes(), "no worker process in the node's namespace"

        run_contract(path, workloads=(runners, runs_on_the_node))
        deadline = time.monotonic() + 30
        while gx1.processes() or sge.queue():
            if time.monotonic() > deadline:
                pytest.fail(f"left on {gx1.name}: {gx1.processes()}, queue {sge.queue()}")
            time.sleep(0.2)
