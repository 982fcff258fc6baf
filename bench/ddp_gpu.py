"""DDP start-up on GPUs: clusterkit's runner on a local-cuda cluster that is up, against torchrun.

One run, repetitions interleaved: ``torchrun --nproc-per-node G`` (G: the GPUs here) of this file,
then ``ddp.run`` of the same training on an embedded ``local-cuda`` cluster (one worker per GPU,
NCCL) once its spare rank processes are ready, as on a cluster in use; and, once, the first
``ddp.run`` on the fresh cluster, before any spare exists. Start-up is launch to the first
training step, split into stages (``in_train``: the training function entered, its process group
made; ``cuda_ready``: the model on the GPU; ``ddp_built``: DistributedDataParallel made).

    python bench/ddp_gpu.py [--reps 3]        # prints "needs a GPU" and exits 0 without one
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

STAGES = ("in_train", "cuda_ready", "ddp_built", "first_step")


def workload(device: Any, marks: dict[str, float]) -> dict[str, float]:
    """200 steps of a 1024x1024 linear layer under DDP; stamps each stage into ``marks``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    layer = torch.nn.Linear(1024, 1024).to(device)
    torch.cuda.synchronize()
    marks["cuda_ready"] = time.time()
    model = DistributedDataParallel(layer)
    marks["ddp_built"] = time.time()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(4096, 1024, device=device)
    for step in range(200):
        optim.zero_grad()
        model(data).pow(2).mean().backward()
        optim.step()
        if step == 0:
            torch.cuda.synchronize()
            marks["first_step"] = time.time()
    torch.cuda.synchronize()
    marks["steps"] = time.time() - marks["first_step"]
    return marks


def train(ctx: Any) -> dict[str, float]:
    return workload(ctx.device, {"in_train": time.time()})


def torchrun_rank() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    marks = workload("cuda", {"in_train": time.time()})
    if dist.get_rank() == 0:
        print(json.dumps(marks), flush=True)
    dist.destroy_process_group()


def run_torchrun(gpus: int) -> tuple[float, dict[str, float]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launched = time.time()
    out = subprocess.run(
        [*command, "--nproc-per-node", str(gpus), __file__, "--rank"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return launched, json.loads(out.strip().splitlines()[-1])


def run_clusterkit(client: Any, wait: bool = True) -> tuple[float, dict[str, float]]:
    from clusterkit.runners import ddp

    if wait:
        ddp.wait_ready(client, timeout=120)  # the spares are warm, as on a cluster in use
    launched = time.time()
    return launched, ddp.run(train, client=client)[0]


def line(name: str, launched: float, marks: dict[str, float]) -> str:
    stages = " ".join(f"{s} {marks[s] - launched:5.2f}" for s in STAGES)
    return f"{name:34s} start {marks['first_step'] - launched:5.2f} s [{stages}]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        torchrun_rank()
        return
    from clusterkit.backends.local import gpu_inventory

    gpus = len(gpu_inventory()[0])
    if not gpus:
        print("bench/ddp_gpu.py needs a GPU: none found here")
        return
    import clusterkit

    starts: dict[str, list[float]] = {"torchrun": [], "clusterkit": []}
    with clusterkit.cluster("local-cuda") as (_, client):
        launched, marks = run_clusterkit(client, wait=False)
        print(line("clusterkit, first run (no spare)", launched, marks), flush=True)
        for rep in range(args.reps):
            for name, run in (
                ("torchrun", lambda: run_torchrun(gpus)),
                ("clusterkit", lambda: run_clusterkit(client)),
            ):
                launched, marks = run()
                starts[name].append(marks["first_step"] - launched)
                print(line(f"rep {rep} {name}", launched, marks), flush=True)
    ratio = statistics.median(
        c / t for c, t in zip(starts["clusterkit"], starts["torchrun"], strict=True)
    )
    print(
        f"\nDDP start on {gpus} GPU(s), NCCL, median of {args.reps}: clusterkit "
        f"{statistics.median(starts['clusterkit']):.2f} s, torchrun "
        f"{statistics.median(starts['torchrun']):.2f} s: {ratio:.2f}x torchrun"
    )


if __name__ == "__main__":
    main()
