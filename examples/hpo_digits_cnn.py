"""Asynchronous hyperparameter search of a small CNN on scikit-learn's bundled digits.

The search space is the one of the classic Dask + skopt notebook: learning rate (log scale),
keep probability, channels and pooling. Each trial reports validation accuracy per epoch, so
Optuna's pruner stops hopeless trials early; a trial uses its worker's GPU when it has one.
The model lives in the sibling module ``digits_model.py``: trials run in this directory, so the
import works on every worker (in place on a shared disk, else a synced copy).

    python examples/hpo_digits_cnn.py                 # embedded `local` profile
    clusterkit hpo examples/hpo_digits_cnn.py:objective --profile slurm-gpu --trials 200 \
        --direction maximize --gpus-per-trial 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import optuna
from digits_model import build_model, load_digits_tensors  # a sibling module of this file

EPOCHS = 8


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
    x_train, y_train, x_val, y_val = load_digits_tensors(device)
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
            workdir=Path(__file__).parent,  # trials import digits_model from here
        )
    print(best_summary(study))
    print(f"report.html, PNG plots and trials.csv: {out}/  ({time.monotonic() - started:.0f} s)")
    print(f"resume or extend: --study-name {args.study_name} --trials N")


if __name__ == "__main__":
    main()
