"""Asynchronous hyperparameter search of a small CNN on scikit-learn's bundled digits.

The search space is the one of the classic Dask + skopt notebook: learning rate (log scale),
keep probability, channels and pooling. Each trial reports validation accuracy per epoch, so
Optuna's pruner stops hopeless trials early; a trial uses its worker's GPU when it has one.

    python examples/hpo_digits_cnn.py                 # embedded `local` profile
    clusterkit hpo examples/hpo_digits_cnn.py:objective --profile slurm-gpu --trials 200 \
        --direction maximize --gpus-per-trial 1
"""

from __future__ import annotations

import argparse
import time

import optuna

EPOCHS = 8


def _data(device: object) -> tuple[object, object, object, object]:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype("float32")[:, None] / 16.0  # (n, 1, 8, 8) in [0, 1]
    x_train, x_val, y_train, y_val = train_test_split(
        x, digits.target, test_size=0.25, stratify=digits.target, random_state=0
    )
    as_tensor = lambda a, dtype: torch.as_tensor(a, dtype=dtype, device=device)  # noqa: E731
    return (
        as_tensor(x_train, torch.float32),
        as_tensor(y_train, torch.long),
        as_tensor(x_val, torch.float32),
        as_tensor(y_val, torch.long),
    )


def build_model(channels: int, keep_prob: float, pool: str) -> object:
    from torch import nn

    pooling = nn.MaxPool2d(2) if pool == "max" else nn.AvgPool2d(2)
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        pooling,  # 8x8 -> 4x4
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(p=1.0 - keep_prob),
        nn.Linear(2 * channels * 16, 10),
    )


def objective(trial: optuna.Trial) -> float:
    """Validation accuracy of the CNN after EPOCHS epochs (maximize)."""
    import torch

    lr = trial.suggest_float("lr", 1e-4, 3e-1, log=True)
    keep_prob = trial.suggest_float("keep_prob", 0.3, 1.0)
    channels = trial.suggest_int("channels", 4, 24, log=True)
    pool = trial.suggest_categorical("pool", ["max", "avg"])

    torch.set_num_threads(1)  # one trial per worker thread: do not oversubscribe the cores
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trial.set_user_attr("device", str(device))
    torch.manual_seed(trial.number)
    x_train, y_train, x_val, y_val = _data(device)
    model = build_model(channels, keep_prob, pool).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    accuracy = 0.0
    for epoch in range(EPOCHS):
        model.train()
        order = torch.randperm(len(x_train), device=device)
        for batch in order.split(128):
            optimizer.zero_grad()
            loss_fn(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_val).argmax(1) == y_val).float().mean().item()
        trial.report(accuracy, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="total finished trials")
    parser.add_argument("--study-name", default=f"digits-cnn-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--storage", default=None, help="default ./STUDY.optuna.log")
    parser.add_argument("--profile", default=None, help="default $CLUSTERKIT_PROFILE or local")
    args = parser.parse_args()

    from clusterkit import get_client
    from clusterkit.runners.hpo import best_summary, run

    out = f"{args.study_name}-results"
    started = time.monotonic()
    with get_client(args.profile) as client:
        study = run(
            objective,
            n_trials=args.trials,
            client=client,
            storage=args.storage,
            study_name=args.study_name,
            direction="maximize",
            pruner=optuna.pruners.MedianPruner(n_startup_trials=6, n_warmup_steps=3),
            out=out,
        )
    print(best_summary(study))
    print(f"plots and trials.csv: {out}/  ({time.monotonic() - started:.0f} s)")
    print(f"resume or extend: --study-name {args.study_name} --trials N")


if __name__ == "__main__":
    main()
