"""GRU classifier on SMILES-like strings with DDP over stratified k folds (clusterkit runner).

The data is generated here: character strings over a SMILES-like alphabet, labelled positive
when they contain an amide group ``C(=O)N``. Each fold is one DDP run on the cluster (one rank
per worker, one per GPU on GPU workers); ranks shard the training set with
``DistributedSampler``, checkpoint every epoch (a restarted group resumes), and rank 0 returns
the held-out accuracy and ROC-AUC, shown as a table.

    python examples/ddp_sequence_classifier.py --profile local --folds 5 --epochs 4
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

MOTIF = "C(=O)N"
TOKENS = ["C", "C", "C", "c", "c", "N", "O", "n", "(", ")", "=", "1", "2", "F", "Cl", "S"]
DECOYS = ["C(=O)O", "C(=N)N", "C(O)N", "N(=O)C", "C(=O)C", "C(=S)N"]
PAD = 0


def make_dataset(n: int, seed: int = 0, max_len: int = 48) -> tuple[list[str], np.ndarray]:
    """Random SMILES-like strings; half carry the amide motif (label 1), the rest never do.

    Both classes get near-miss decoys (ester, amidine, ...) so the model has to learn the
    exact substructure, not just "has C, =, O and N near each other".
    """
    rng = random.Random(seed)
    smiles, labels = [], []
    while len(smiles) < n:
        body = "".join(rng.choice(TOKENS) for _ in range(rng.randint(8, max_len - 12)))
        positive = len(smiles) % 2 == 0
        for fragment in [MOTIF] * positive + [rng.choice(DECOYS)] * (rng.random() < 0.7):
            cut = rng.randint(0, len(body))
            body = body[:cut] + fragment + body[cut:]
        if (MOTIF in body) != positive:
            continue
        smiles.append(body)
        labels.append(int(positive))
    return smiles, np.array(labels)


def encode(smiles: list[str]) -> tuple[np.ndarray, dict[str, int]]:
    """Character-level token ids, right-padded with 0."""
    vocab = {ch: i + 1 for i, ch in enumerate(sorted({c for s in smiles for c in s}))}
    width = max(map(len, smiles))
    ids = np.zeros((len(smiles), width), dtype=np.int64)
    for row, text in enumerate(smiles):
        ids[row, : len(text)] = [vocab[c] for c in text]
    return ids, vocab


def build_model(vocab_size: int, hparams: dict):
    import torch
    from torch import nn

    class RNNPredictor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab_size + 1, hparams["embedding_dim"], padding_idx=PAD)
            self.rnn = nn.GRU(
                hparams["embedding_dim"],
                hparams["d_model"],
                num_layers=hparams["num_layers"],
                batch_first=True,
                bidirectional=True,
                dropout=hparams["dropout"] if hparams["num_layers"] > 1 else 0.0,
            )
            self.head = nn.Linear(2 * hparams["d_model"], 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            mask = (ids != PAD).unsqueeze(-1)
            out, _ = self.rnn(self.embed(ids))
            pooled = out.masked_fill(~mask, float("-inf")).max(dim=1).values
            return self.head(pooled).squeeze(-1)

    return RNNPredictor()


def train_fold(ctx, fold: int, ids, labels, train_idx, test_idx, hparams: dict) -> dict:
    """One rank of one fold: DDP training with checkpoints, then held-out metrics."""
    import torch
    from sklearn.metrics import accuracy_score, roc_auc_score
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(hparams["seed"] + fold)
    x, y = torch.from_numpy(ids), torch.from_numpy(labels).float()
    train_set = TensorDataset(x[train_idx], y[train_idx])
    sampler = DistributedSampler(train_set, shuffle=True, seed=hparams["seed"])
    loader = DataLoader(train_set, batch_size=hparams["batch_size"], sampler=sampler)

    model = build_model(int(x.max()), hparams).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
    optim = torch.optim.AdamW(ddp.parameters(), lr=hparams["learning_rate"], weight_decay=1e-4)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    start = 0
    state = ctx.load_checkpoint()
    if state is not None:  # a restarted group resumes where rank 0 last saved
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["epoch"]
    epoch_times = []
    for epoch in range(start, hparams["epochs"]):
        began = time.perf_counter()
        sampler.set_epoch(epoch)
        ddp.train()
        for xb, yb in loader:
            optim.zero_grad()
            loss = loss_fn(ddp(xb.to(ctx.device)), yb.to(ctx.device))
            loss.backward()
            optim.step()
        epoch_times.append(time.perf_counter() - began)
        ctx.save_checkpoint(
            {"epoch": epoch + 1, "model": model.state_dict(), "optim": optim.state_dict()}
        )

    if ctx.rank != 0:
        return {}
    model.eval()
    with torch.no_grad():
        scores = torch.sigmoid(model(x[test_idx].to(ctx.device))).cpu().numpy()
    truth = labels[test_idx]
    return {
        "fold": fold,
        "train": len(train_idx),
        "heldout": len(test_idx),
        "accuracy": float(accuracy_score(truth, scores > 0.5)),
        "roc_auc": float(roc_auc_score(truth, scores)),
        "epoch_s": float(np.mean(epoch_times)) if epoch_times else 0.0,
        "world_size": ctx.world_size,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    from sklearn.model_selection import StratifiedKFold

    from clusterkit import console, get_client
    from clusterkit.runners import ddp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="clusterkit profile (default: local)")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--max-restarts", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    smiles, labels = make_dataset(args.samples, seed=args.seed)
    ids, _ = encode(smiles)
    hparams = dict(
        embedding_dim=32,
        d_model=64,
        num_layers=1,
        dropout=0.2,
        learning_rate=3e-3,
        batch_size=64,
        epochs=args.epochs,
        seed=args.seed,
    )
    folds = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    rows = []
    client = get_client(args.profile)
    try:
        for fold, (train_idx, test_idx) in enumerate(folds.split(ids, labels)):
            began = time.perf_counter()
            results = ddp.run(
                train_fold,
                fold,
                ids,
                labels,
                train_idx,
                test_idx,
                hparams,
                client=client,
                world_size=args.world_size,
                max_restarts=args.max_restarts,
            )
            rows.append({**results[0], "wall_s": time.perf_counter() - began})
    finally:
        client.close()
    console.table(
        f"GRU on SMILES-like strings, {args.folds}-fold stratified CV, DDP",
        ["fold", "ranks", "train", "held-out", "accuracy", "ROC-AUC", "epoch s", "fold wall s"],
        [
            (
                r["fold"],
                r["world_size"],
                r["train"],
                r["heldout"],
                f"{r['accuracy']:.3f}",
                f"{r['roc_auc']:.3f}",
                f"{r['epoch_s']:.2f}",
                f"{r['wall_s']:.1f}",
            )
            for r in rows
        ]
        + [
            (
                "mean",
                "",
                "",
                "",
                f"{np.mean([r['accuracy'] for r in rows]):.3f}",
                f"{np.mean([r['roc_auc'] for r in rows]):.3f}",
                "",
                "",
            )
        ],
    )
    return rows


if __name__ == "__main__":
    main()
