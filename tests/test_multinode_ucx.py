"""`protocol: ucx` across nodes (tests/multinode.py): UCX's TCP transport between the login
node's scheduler and a worker on each of three compute nodes, each a network namespace whose
only way to the others is ``eth0``.

``clusterkit up`` of a slurm profile with ``protocol: ucx`` and ``interface: eth0``; every
address is ``ucx://`` on a node's eth0 address; arrays move worker to worker between nodes;
UCX's lanes are on eth0 (not lo, not a docker0 of the same address on every node), with
nothing but the profile's ``UCX_TLS=tcp`` (no ``UCX_NET_DEVICES``); ``down`` leaves nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests import multinode as M
from tests.multinode import clusterkit, nothing_left, profile, python

pytestmark = pytest.mark.multinode

#: Each worker's array goes to the next node's worker, which sums it: every pair of nodes
#: carries data worker to worker, not through the scheduler or the client.
RING = """
    import json, os, socket, sys
    import numpy as np
    from distributed import get_worker
    import clusterkit

    def where_and_sum(array):
        worker = get_worker()
        got = [[t["who"], t["total"]] for t in worker.transfer_incoming_log]  # fetched: from, bytes
        return socket.gethostname(), worker.address, float(array.sum()), got

    client = clusterkit.get_client(sys.argv[1])
    info = client.scheduler_info(n_workers=-1)
    workers = sorted(info["workers"], key=lambda a: info["workers"][a]["host"])
    hosts = {a: client.run(socket.gethostname, workers=[a])[a] for a in workers}
    moves = []
    for i, source in enumerate(workers):
        target = workers[(i + 1) % len(workers)]
        array = np.full(2_000_000, float(i + 1))  # 16 MB
        [data] = client.scatter([array], workers=[source], broadcast=False)
        summed = client.submit(where_and_sum, data, workers=[target], allow_other_workers=False,
                               pure=False)
        host, ran_on, total, fetched = summed.result(timeout=120)
        moves.append({"from": hosts[source], "to": host, "ran_on": ran_on, "sum": total,
                      "fetched": fetched, "source": source, "target": target})
    env = client.run(lambda: {k: v for k, v in os.environ.items() if k.startswith("UCX_")})
    print(json.dumps({"scheduler": client.scheduler.address, "workers": workers,
                      "hosts": hosts, "moves": moves, "env": env}))
"""


def docker0(nodes: M.MultiNode, up: bool) -> None:
    """What Docker leaves on every host: ``docker0`` with the same 172.17.0.1/16 (a veth whose
    peer is up, as with a container running), a second way out that reaches no other node."""
    for node in (M.LOGIN, *M.NODES):
        ns = nodes.netns(node)
        if up:
            M._run("ip", "-n", ns, "link", "add", "docker0", "type", "veth", "peer", "vethc0")
            M._run("ip", "-n", ns, "addr", "add", "172.17.0.1/16", "dev", "docker0")
            M._run("ip", "-n", ns, "link", "set", "vethc0", "up")
            M._run("ip", "-n", ns, "link", "set", "docker0", "up")
        else:
            subprocess.run(["ip", "-n", ns, "link", "del", "docker0"], capture_output=True)


def lanes(logs: Path) -> dict[str, set[str]]:
    """The devices UCX chose for each job's inter-node protocols (``UCX_PROTO_INFO=y`` prints
    a table per protocol, each row ending in its ``transport/device``): job log -> devices."""
    found = {}
    for log in sorted(logs.glob("*.out")):  # where UCX prints it
        text = log.read_text(errors="replace")
        found[log.name] = set(re.findall(r"\|\s+(\w+/[\w.:-]+)\s+\|\s*$", text, re.M))
    return found


def test_ucx_cluster_moves_arrays_between_nodes(nodes: M.MultiNode, tmp_path: Path) -> None:
    """Three workers on three nodes over UCX (TCP transport), a docker0 of the same address on
    every node besides eth0: every address is ucx:// on a node's eth0 address, arrays move
    worker to worker between every pair of nodes, UCX's lanes are tcp/eth0 and nothing else;
    `down` leaves nothing on any node."""
    env = {"CLUSTERKIT_STATE_DIR": str(tmp_path / "state")}
    path = profile(tmp_path, "ucx", protocol="ucx", env={"UCX_PROTO_INFO": "y"})
    docker0(nodes, True)
    done = clusterkit(nodes, "up", str(path), "--name", "ucx", env=env)
    try:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        seen = python(nodes, RING, "ucx", env=env, timeout=240)
        assert seen["scheduler"].startswith(f"ucx://{M.address(M.LOGIN)}:"), seen
        assert all(a.startswith("ucx://") for a in seen["workers"]), seen
        addresses = {a.split("//")[1].rsplit(":", 1)[0] for a in seen["workers"]}
        assert addresses == {M.address(node) for node in M.NODES}, seen  # not 127.0.0.1
        assert sorted(seen["hosts"].values()) == list(M.NODES), seen
        for worker, host in seen["hosts"].items():
            assert worker.startswith(f"ucx://{M.address(host)}:"), seen
        for i, move in enumerate(seen["moves"]):
            assert move["from"] != move["to"], move  # across nodes
            assert move["ran_on"] == move["target"], move
            assert move["sum"] == 2_000_000 * (i + 1), move
            fetched = [(who, n) for who, n in move["fetched"] if who == move["source"]]
            assert fetched and fetched[0][1] >= 16_000_000, move  # worker to worker, 16 MB
        tls = {worker: variables.get("UCX_TLS") for worker, variables in seen["env"].items()}
        assert tls == dict.fromkeys(seen["workers"], "tcp"), seen["env"]
        chosen = lanes(tmp_path / "joblogs")
        assert len(chosen) == 3 and all(d == {"tcp/eth0"} for d in chosen.values()), chosen
        done = clusterkit(nodes, "down", "ucx", env=env)
        assert done.returncode == 0, done.stderr
        nothing_left(nodes)
    finally:
        clusterkit(nodes, "down", "ucx", env=env)
        nodes.empty_queue()
        docker0(nodes, False)
