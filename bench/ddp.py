"""DDP benchmark: epoch time and startup of clusterkit's runner vs torchrun, side by side.

One run, repetitions interleaved (order rotated each repetition), the same GRU, data and
epochs under: (1) a single process, (2) ``torchrun --nproc-per-node 2``, (3) clusterkit's runner
on a LocalCluster that is already up, (4) the same from a cold start (cluster included), and
for reference (5, 6) a naive Dask launch that runs the rank inside the worker thread, with the
worker's statistical profiler on and off. Startup is launch to the first training step.
Ratios are to torchrun in the same repetition; the table shows their medians.

    .venv/bin/python bench/ddp.py [--reps 3] [--epochs 4] [--samples 2048] [--preload-ab]

``--preload-ab`` adds clusterkit on a second cluster whose spare rank processes import torch
only (``CLUSTERKIT_DDP_PRELOAD=0``, the default before the preload), so that both are measured
in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CONFIG = {"samples": 2048, "length": 40, "vocab": 20, "hidden": 96, "batch": 32, "epochs": 4}


def workload(rank: int, world: int, cfg: dict, distributed: bool) -> dict:
    """The measured training: identical in every mode. Returns first-step time and epochs."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randint(1, cfg["vocab"], (cfg["samples"], cfg["length"]), generator=generator)
    y = (x == 3).any(dim=1).float()
    data = TensorDataset(x, y)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg["vocab"], 32)
            self.rnn = nn.GRU(32, cfg["hidden"], batch_first=True, bidirectional=True)
            self.head = nn.Linear(2 * cfg["hidden"], 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(self.embed(ids))
            return self.head(out[:, -1]).squeeze(-1)

    model: nn.Module = Net()
    sampler = None
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=cfg["batch"], sampler=sampler, shuffle=sampler is None)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    first_step = None
    epochs = []
    for epoch in range(cfg["epochs"]):
        if sampler is not None:
            sampler.set_epoch(epoch)
        began = time.perf_counter()
        for xb, yb in loader:
            if first_step is None:
                first_step = time.time()
            optim.zero_grad()
            loss_fn(model(xb), yb).backward()
            optim.step()
        epochs.append(time.perf_counter() - began)
    return {"first_step": first_step, "epochs": epochs, "threads": torch.get_num_threads()}


def clusterkit_rank(ctx: Any, cfg: dict) -> dict:
    return workload(ctx.rank, ctx.world_size, cfg, True)


def naive_rank(rank: int, port: int, cfg: dict, profiler: bool) -> dict:
    """What people write by hand: the rank in the worker thread, a fixed port, env set."""
    import torch.distributed as dist
    from distributed import get_worker

    from clusterkit.runners.ddp.worker import _set_profiler

    worker = get_worker()
    if not profiler:
        _set_profiler(worker, pause=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        return workload(rank, 2, cfg, True)
    finally:
        dist.destroy_process_group()
        if not profiler:
            _set_profiler(worker, pause=False)


# ---------------------------------------------------------------- the modes


def _subprocess_mode(argv: list[str], cfg: dict) -> tuple[float, dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        launched = time.time()
        subprocess.run(
            [*argv, __file__, "--child", out.name, "--config", json.dumps(cfg)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return launched, json.load(open(out.name))


def run_single(cfg: dict, _: Any) -> tuple[float, dict]:
    return _subprocess_mode([sys.executable], cfg)


def run_torchrun(cfg: dict, _: Any) -> tuple[float, dict]:
    return _subprocess_mode(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        cfg,
    )


def run_clusterkit(cfg: dict, client: Any) -> tuple[float, dict]:
    from clusterkit.runners import ddp

    ddp.wait_ready(client)  # the spare rank processes are warm, as on a cluster in use
    launched = time.time()
    return launched, ddp.run(clusterkit_rank, cfg, client=client)[0]


def _local_cluster(**env: str) -> Any:
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
        env=env or None,
    )


#: --preload-ab: a second cluster whose spares import torch only (CLUSTERKIT_DDP_PRELOAD=0)
TORCH_ONLY: dict[str, Any] = {}


def run_clusterkit_torch_only(cfg: dict, _: Any) -> tuple[float, dict]:
    return run_clusterkit(cfg, TORCH_ONLY["client"])


def run_cold(cfg: dict, _: Any) -> tuple[float, dict]:
    from distributed import Client

    from clusterkit.runners import ddp

    launched = time.time()
    with _local_cluster() as cluster, Client(cluster) as client:
        result = ddp.run(clusterkit_rank, cfg, client=client)[0]
    return launched, result


def _naive(cfg: dict, client: Any, profiler: bool) -> tuple[float, dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    launched = time.time()
    futures = [
        client.submit(naive_rank, r, port, cfg, profiler, workers=[w], pure=False)
        for r, w in enumerate(workers)
    ]
    return launched, client.gather(futures)[0]


def run_naive(cfg: dict, client: Any) -> tuple[float, dict]:
    return _naive(cfg, client, profiler=True)


def run_naive_noprof(cfg: dict, client: Any) -> tuple[float, dict]:
    return _naive(cfg, client, profiler=False)


MODES = {
    "single process": run_single,
    "torchrun x2": run_torchrun,
    "clusterkit (cluster up)": run_clusterkit,
    "clusterkit (cold start)": run_cold,
    "clusterkit, torch-only spare": run_clusterkit_torch_only,
    "naive dask, profiler on": run_naive,
    "naive dask, profiler off": run_naive_noprof,
}


def child(out: str, cfg: dict) -> None:
    """Inside `python bench/ddp.py --child` (single) or under torchrun (one per rank)."""
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        result = workload(dist.get_rank(), dist.get_world_size(), cfg, True)
        rank = dist.get_rank()
        dist.destroy_process_group()
    else:
        result, rank = workload(0, 1, cfg, False), 0
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=CONFIG["epochs"])
    parser.add_argument("--samples", type=int, default=CONFIG["samples"])
    parser.add_argument("--child", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument(
        "--preload-ab", action="store_true", help="and spares without the preload (before)"
    )
    args = parser.parse_args()
    if args.child:
        child(args.child, json.loads(args.config))
        return
    from distributed import Client

    cfg = dict(CONFIG, epochs=args.epochs, samples=args.samples)
    names = [m for m in MODES if args.preload_ab or MODES[m] is not run_clusterkit_torch_only]
    rows: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in names}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(stack.enter_context(_local_cluster())))
        if args.preload_ab:
            other = stack.enter_context(_local_cluster(CLUSTERKIT_DDP_PRELOAD="0"))
            TORCH_ONLY["client"] = stack.enter_context(Client(other))
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            measured = {}
            for name in order:
                launched, result = MODES[name](cfg, client)
                epoch = statistics.mean(result["epochs"][1:])
                startup = result["first_step"] - launched
                measured[name] = (epoch, startup)
                print(
                    f"rep {rep} {name:26s} epoch {epoch:6.2f}s startup {startup:6.2f}s "
                    f"threads {result['threads']}",
                    file=sys.stderr,
                    flush=True,
                )
            base_epoch, base_start = measured["torchrun x2"]
            for name, (epoch, startup) in measured.items():
                rows[name].append((epoch, startup, epoch / base_epoch, startup / base_start))
    print(f"\nDDP bench: {args.reps} interleaved repetitions, {cfg}, 2 cores, gloo")
    print(
        f"{'mode':28s} {'epoch s':>8s} {'startup s':>10s} {'epoch/torchrun':>15s} "
        f"{'startup/torchrun':>17s}"
    )
    for name, values in rows.items():
        med = [statistics.median(v[i] for v in values) for i in range(4)]
        print(f"{name:28s} {med[0]:8.2f} {med[1]:10.2f} {med[2]:14.2f}x {med[3]:16.2f}x")
    print("(medians over repetitions of per-repetition ratios; epoch = mean of epochs 2..n)")


if __name__ == "__main__":
    main()
