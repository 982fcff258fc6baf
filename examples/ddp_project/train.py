"""A torchrun-style DDP script: sibling imports, a config file, a snapshot every epoch.

    torchrun --nproc_per_node 2 train.py 3 1          # plain PyTorch
    clusterkit train train.py --world-size 2 -- 3 1   # the same script on any profile

Arguments: total epochs, snapshot every N epochs. The snapshot goes to ``snapshot.pt`` in the
working directory (the project directory under clusterkit when the disk is shared) or, when
``clusterkit train --checkpoint-dir URL`` is given, to ``URL/snapshot.pt`` (any fsspec URL),
and a rerun resumes from it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datautils import MyTrainDataset
from model import build_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

CONFIG = json.loads(Path(__file__).with_name("config.json").read_text())
SNAPSHOT = os.path.join(os.environ.get("CLUSTERKIT_CHECKPOINT_DIR", "."), "snapshot.pt")


def load_snapshot(model: torch.nn.Module) -> dict:
    fs, path = fsspec.core.url_to_fs(SNAPSHOT)
    if not fs.exists(path):
        return {"epochs_run": 0, "runs": []}
    with fs.open(path, "rb") as handle:
        snapshot = torch.load(handle, weights_only=False)
    model.load_state_dict(snapshot["model"])
    print(f"resuming from snapshot at epoch {snapshot['epochs_run']}")
    return snapshot


def save_snapshot(model: DDP, snapshot: dict) -> None:
    snapshot["model"] = model.module.state_dict()
    fs, path = fsspec.core.url_to_fs(SNAPSHOT)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as handle:
        torch.save(snapshot, handle)


def main(total_epochs: int, save_every: int) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(CONFIG["seed"])
    data = MyTrainDataset(CONFIG["samples"], CONFIG["features"], CONFIG["seed"])
    loader = DataLoader(data, CONFIG["batch_size"], sampler=DistributedSampler(data))
    model = build_model(CONFIG["features"])
    snapshot = load_snapshot(model)
    snapshot["runs"].append({"started_at": snapshot["epochs_run"], "world": dist.get_world_size()})
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=CONFIG["lr"])
    for epoch in range(snapshot["epochs_run"], total_epochs):
        loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
        snapshot["epochs_run"], snapshot["loss"] = epoch + 1, loss.item()
        if dist.get_rank() == 0 and (epoch + 1) % save_every == 0:
            save_snapshot(ddp, snapshot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
