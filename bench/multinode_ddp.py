"""Multi-node DDP, clusterkit against torchrun, side by side on the multi-node SLURM of the tests.

One run brings up tests/multinode.py (a login node and three compute nodes, each a network and
UTS namespace on one bridge: run as root), then trains the same torchrun-style DDP script (an
MLP on synthetic data, DistributedSampler, gloo, CPU) with 4 ranks over 2 nodes x 2 two ways:

- clusterkit: ``clusterkit train train.py -p bench --world-size 4`` from the login node, on a
  ``clusterkit up`` cluster of two jobs of two worker processes (one job per node);
- torchrun: ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint
  <n1>:PORT --rdzv-conf is_host=1|0 --local-addr <node>`` entered into n1 and n2
  (``MultiNode.enter``), with ``GLOO_SOCKET_IFNAME=eth0``: the node names resolve nowhere, so
  torchrun is told which node hosts the rendezvous store (else it looks its own name up and
  fails, ``socket.gaierror``), each node's address and gloo's interface (clusterkit sets
  ``MASTER_ADDR`` and ``GLOO_SOCKET_IFNAME`` itself).

Rank 0 times each epoch (a barrier at its end) and writes the times; the steady epoch is the
median of the epochs after the first; launch to end is the command's wall time (clusterkit's
cluster is up before it). The order alternates over ``--reps``; the table gives each side's
median, the median of the per-repetition ratios clusterkit/torchrun, and the load average
around the runs; each rank's page faults per steady epoch and the cores each kind of process
used over the steady epochs tell where a difference comes from. The cluster stays up, idle,
while torchrun runs on its nodes: ``--frozen`` adds torchrun with the cluster's processes
stopped (SIGSTOP), torchrun as on a site without Dask. Everything it starts is stopped at the
end (cluster, daemons, namespaces).

    sudo .venv/bin/python bench/multinode_ddp.py [--reps 4] [--epochs 6] [--frozen]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import multinode as M  # noqa: E402

TRAIN = """\
import json, os, resource, socket, sys, time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CONFIG = {config}


def main(out: str, epochs: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(CONFIG["samples"], CONFIG["features"], generator=generator)
    y = x.sum(dim=1, keepdim=True).tanh()
    data = TensorDataset(x, y)
    torch.manual_seed(0)
    width = CONFIG["hidden"]
    model = torch.nn.Sequential(
        torch.nn.Linear(CONFIG["features"], width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1),
    )
    ddp = DDP(model)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, CONFIG["batch"], sampler=sampler)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times, window = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        if epoch == 1:
            window.append(time.time())
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        began = time.perf_counter()
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.mse_loss(ddp(inputs), targets).backward()
            optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - began)
        if rank == 0:
            print(f"epoch {{epoch}}: {{times[-1]:.3f}}s", flush=True)
    window.append(time.time())
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (epochs - 1)
    hosts = [None] * world
    dist.all_gather_object(hosts, [socket.gethostname(), os.environ.get("LOCAL_RANK"), faults])
    if rank == 0:
        seen = {{"epochs": times, "hosts": hosts, "threads": torch.get_num_threads(),
                "window": window}}
        with open(out, "w") as handle:
            json.dump(seen, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
"""

CONFIG = {"samples": 16384, "features": 64, "hidden": 512, "batch": 64}
TORCHRUN_NODES = ("n1", "n2")


def clusterkit_side(nodes: M.MultiNode, env: dict[str, str], script: Path, out: Path,
                    epochs: int, rep: int) -> None:  # fmt: skip
    done = M.clusterkit(
        nodes, "train", str(script), "-p", "bench", "--world-size", "4", "--timeout", "600",
        "--", str(out), str(epochs), env=env, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"clusterkit train: {done.stdout[-2000:]}{done.stderr[-3000:]}")


def torchrun_side(nodes: M.MultiNode, env: dict[str, str], script: Path, out: Path,
                  epochs: int, rep: int) -> None:  # fmt: skip
    endpoint = f"{M.address(TORCHRUN_NODES[0])}:{29400 + rep}"
    launched = []
    try:
        for node in TORCHRUN_NODES:
            host = int(node == TORCHRUN_NODES[0])  # the store's host: the names resolve nowhere
            command = [*nodes.enter(node), sys.executable, "-m", "torch.distributed.run",
                       "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", f"bench{rep}",
                       "--rdzv-conf", f"is_host={host}", "--local-addr", M.address(node),
                       str(script), str(out), str(epochs)]  # fmt: skip
            launched.append(
                subprocess.Popen(
                    command,
                    cwd=script.parent,
                    env={**os.environ, "GLOO_SOCKET_IFNAME": M.INTERFACE},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [process.communicate(timeout=900)[0] for process in launched]
        failed = [o for p, o in zip(launched, outputs, strict=True) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"torchrun: {failed[0][-3000:]}")
    finally:
        for process in launched:
            if process.poll() is None:
                process.kill()
                process.communicate()


def torchrun_frozen_side(nodes: M.MultiNode, env: dict[str, str], script: Path, out: Path,
                         epochs: int, rep: int) -> None:  # fmt: skip
    """torchrun with the Dask cluster's processes stopped (SIGSTOP): what the idle cluster
    costs the nodes, which torchrun alone on a site would not pay."""
    kinds = ("dask worker+nanny", "clusterkit on login (scheduler, driver)")
    frozen = [pid for node in (M.LOGIN, *M.NODES) for pid in nodes.processes(node)
              if _kind(pid) in kinds]  # fmt: skip
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        torchrun_side(nodes, env, script, out, epochs, rep + 100)
    finally:
        for pid in frozen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)


SIDES = {"clusterkit": clusterkit_side, "torchrun": torchrun_side}
FROZEN = "torchrun, cluster stopped"
RUNNERS = {**SIDES, FROZEN: torchrun_frozen_side}

#: What a process on a node is, by its command line (first match)
KINDS = (("torchrun agent", ("torch.distributed.run",)),
         ("clusterkit on login (scheduler, driver)", ("-m clusterkit ",)),
         ("rank", ("clusterkit.runners.ddp.rank", "train.py")),
         ("dask worker+nanny", ("dask_worker", "multiprocessing")),
         ("slurm", ("slurm",)))  # fmt: skip
TICK = os.sysconf("SC_CLK_TCK")


def _kind(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    return next((kind for kind, marks in KINDS if any(m in cmdline for m in marks)), "other")


class CpuSampler:
    """CPU time of every process on the login node and the compute nodes, sampled every
    0.25 s: how many cores each kind of process used over the steady epochs."""

    def __init__(self, nodes: M.MultiNode) -> None:
        self.nodes, self.samples = nodes, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        kinds: dict[int, str] = {}
        while not self.stop.wait(0.25):
            ticks = {}
            for node in (M.LOGIN, *M.NODES):
                for pid in self.nodes.pids(node):
                    with contextlib.suppress(OSError, IndexError):
                        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                        kinds.setdefault(pid, _kind(pid))
                        ticks[pid] = (kinds[pid], (int(fields[11]) + int(fields[12])) / TICK)
            self.samples.append((time.time(), ticks))

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Cores used per kind of process between ``start`` and ``end`` (wall clock)."""
        self.stop.set()
        self.thread.join()
        inside = [s for s in self.samples if start <= s[0] <= end] or self.samples
        first, last = inside[0], inside[-1]
        used: dict[str, float] = {}
        for pid, (kind, after) in last[1].items():
            if pid in first[1]:
                used[kind] = used.get(kind, 0.0) + after - first[1][pid][1]
        span = max(last[0] - first[0], 1e-9)
        return {kind: cpu / span for kind, cpu in sorted(used.items())}


def measure(side: str, nodes: M.MultiNode, env: dict[str, str], script: Path, epochs: int,
            rep: int) -> dict[str, Any]:  # fmt: skip
    out = script.parent / f"{side}-{rep}.json"
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    sampler = CpuSampler(nodes)
    RUNNERS[side](nodes, env, script, out, epochs, rep)
    seen = json.loads(out.read_text())
    seen["cores"] = sampler.cores(*seen["window"])
    seen["wall"] = time.monotonic() - started
    seen["load"] = (load_before + os.getloadavg()[0]) / 2
    seen["steady"] = statistics.median(seen["epochs"][1:])
    layout = [host for host, _, _ in seen["hosts"]]
    seen["faults"] = statistics.mean(faults for _, _, faults in seen["hosts"])
    if not (layout[0] == layout[1] != layout[2] == layout[3]):  # 2 nodes x 2, by node
        raise RuntimeError(f"{side}: ranks not 2 per node over 2 nodes: {seen['hosts']}")
    epochs_text = " ".join(f"{t:.2f}" for t in seen["epochs"])
    print(f"rep {rep} {side:10s} steady {seen['steady']:.3f}s  epochs [{epochs_text}]  "
          f"nodes {sorted(set(layout))}  threads {seen['threads']}  load {seen['load']:.2f}  "
          f"wall {seen['wall']:.1f}s  page faults/epoch/rank {seen['faults']:.0f}",
          flush=True)  # fmt: skip
    used = ", ".join(f"{kind} {cores:.2f}" for kind, cores in seen["cores"].items())
    print(f"      cores used over the steady epochs: {used}", flush=True)
    return seen


def run(directory: Path, reps: int, epochs: int, frozen: bool) -> dict[str, list[dict[str, Any]]]:
    project = directory / "project"
    project.mkdir()
    script = project / "train.py"
    script.write_text(TRAIN.format(config=json.dumps(CONFIG)))
    env = {"CLUSTERKIT_STATE_DIR": str(directory / "state")}
    nodes = M.start(directory / "slurm")
    try:
        path = M.profile(directory, "bench", workers=4, processes=2, cores=2, memory="2GiB")
        done = M.clusterkit(nodes, "up", str(path), "--name", "bench", env=env)
        if done.returncode != 0:
            raise RuntimeError(f"clusterkit up: {done.stderr[-3000:]}")
        print(f"cluster up: jobs {nodes.queue()}", flush=True)
        names = [*SIDES, *([FROZEN] if frozen else [])]
        found: dict[str, list[dict[str, Any]]] = {side: [] for side in names}
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for side in order:
                found[side].append(measure(side, nodes, env, script, epochs, rep))
        return found
    finally:
        M.clusterkit(nodes, "down", "bench", env=env)
        nodes.stop()


def report(found: dict[str, list[dict[str, Any]]], reps: int, epochs: int) -> None:
    loads = [seen["load"] for side in found.values() for seen in side]
    print(f"\nmulti-node DDP, 4 ranks over 2 nodes x 2 (gloo, CPU), {epochs} epochs, "
          f"{reps} alternating repetitions, {CONFIG}")  # fmt: skip
    print(f"{'side':26s} {'steady epoch s':>15s} {'launch to end s':>16s} "
          f"{'page faults/epoch/rank':>23s}  per rep (steady)")  # fmt: skip
    for side, seen in found.items():
        each = " ".join(f"{s['steady']:.3f}" for s in seen)
        steady, wall, faults = (statistics.median(s[k] for s in seen)
                                for k in ("steady", "wall", "faults"))  # fmt: skip
        print(f"{side:26s} {steady:15.3f} {wall:16.1f} {faults:23.0f}  {each}")
    for base in [side for side in found if side != "clusterkit"]:
        pairs = zip(found["clusterkit"], found[base], strict=True)
        ratios = [a["steady"] / b["steady"] for a, b in pairs]
        print(f"steady epoch clusterkit/{base}: median {statistics.median(ratios):.3f}x "
              f"[{min(ratios):.3f}-{max(ratios):.3f}] (target <= 1.05x)")  # fmt: skip
    print("medians over repetitions; each ratio within one repetition")
    print(f"load average (1 min) around the runs: {min(loads):.1f}-{max(loads):.1f} "
          f"on {os.cpu_count()} cores")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--frozen", action="store_true",
                        help="and torchrun with the Dask cluster stopped (SIGSTOP)")  # fmt: skip
    args = parser.parse_args()
    reason = M.missing_reason()
    if reason:
        sys.exit(f"the multi-node SLURM cannot start here: {reason}")
    with tempfile.TemporaryDirectory(prefix="ck-mn-ddp-") as directory:
        found = run(Path(directory), args.reps, args.epochs, args.frozen)
    report(found, args.reps, args.epochs)


if __name__ == "__main__":
    main()
