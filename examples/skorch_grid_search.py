"""skorch ``GridSearchCV`` through joblib's Dask backend on ``clusterkit.get_client()``.

The skorch documentation's parallelism recipe, with the cluster coming from a profile: each
fit of the grid runs on a Dask worker (on its GPU when the worker has one).

    python examples/skorch_grid_search.py                    # embedded `local` profile
    CLUSTERKIT_PROFILE=slurm-gpu python examples/skorch_grid_search.py
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import GridSearchCV
from skorch import NeuralNetClassifier
from torch import nn


class MLP(nn.Module):
    """A small classifier for 8x8 digit images flattened to 64 features."""

    def __init__(self, hidden: int = 32, dropout: float = 0.2) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_search(n_jobs: int = -1) -> GridSearchCV:
    net = NeuralNetClassifier(
        MLP,
        criterion=nn.CrossEntropyLoss,
        optimizer=torch.optim.Adam,
        max_epochs=8,
        batch_size=64,
        train_split=None,
        verbose=0,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    grid = {"lr": [0.003, 0.01], "module__hidden": [16, 64]}
    return GridSearchCV(net, grid, scoring="accuracy", cv=3, refit=False, n_jobs=n_jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="default $CLUSTERKIT_PROFILE or local")
    args = parser.parse_args()

    import joblib

    from clusterkit import get_client

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    with get_client(args.profile) as client, joblib.parallel_backend("dask"):
        print(f"dashboard: {client.dashboard_link}")
        search = make_search().fit(x, y)
    for params, score in zip(
        search.cv_results_["params"], search.cv_results_["mean_test_score"], strict=True
    ):
        print(f"{score:.3f}  {params}")
    print(f"best: {search.best_score_:.3f} with {search.best_params_}")


if __name__ == "__main__":
    main()
