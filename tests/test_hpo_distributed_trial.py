"""Optuna's distributed-trial convention in gang trials (``ranks_per_trial=2``, gloo on CPU, a
real LocalCluster): an objective in the shape of Optuna's own ``pytorch_distributed_simple.py``
(``TorchDistributedTrial(single_trial)``, a trial on rank 0 and None on the others, the process
group left to the launcher) runs unchanged, and every trial on a reused rank process passes the
first time (``TorchDistributedTrial`` caches its process group in a module global)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import cloudpickle
import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo.inputs import ATTR_ATTEMPTS, ATTR_ERROR

# seam: optuna-integration's TorchDistributedTrial on torch's process groups
pytestmark = [pytest.mark.local, pytest.mark.seam]
pytest.importorskip("optuna_integration.pytorch_distributed")
optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---------------------------------------------------------------------- Optuna's example's shape
# Its objective and helpers as the example writes them, on scikit-learn's digits (no download)
# instead of FashionMNIST; the example's __main__ (init_process_group, a loop of objective(None)
# on the other ranks) is what the gang trial does for it.

BATCHSIZE = 32
CLASSES = 10
EPOCHS = 2
N_TRAIN_EXAMPLES = BATCHSIZE * 8
N_VALID_EXAMPLES = BATCHSIZE * 4


def define_model(trial):  # type: ignore[no-untyped-def]
    import torch.nn as nn

    n_layers = trial.suggest_int("n_layers", 1, 2)
    layers = []
    in_features = 64
    for i in range(n_layers):
        out_features = trial.suggest_int(f"n_units_l{i}", 4, 32)
        layers.append(nn.Linear(in_features, out_features))
        layers.append(nn.ReLU())
        p = trial.suggest_float(f"dropout_l{i}", 0.2, 0.5)
        layers.append(nn.Dropout(p))
        in_features = out_features
    layers.append(nn.Linear(in_features, CLASSES))
    layers.append(nn.LogSoftmax(dim=1))
    return nn.Sequential(*layers)


def get_digits():  # type: ignore[no-untyped-def]
    import torch
    import torch.utils.data
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    data = torch.tensor(features / 16.0, dtype=torch.float32)
    target = torch.tensor(labels, dtype=torch.long)
    train_dataset = torch.utils.data.TensorDataset(
        data[:N_TRAIN_EXAMPLES], target[:N_TRAIN_EXAMPLES]
    )
    valid_dataset = torch.utils.data.TensorDataset(
        data[-N_VALID_EXAMPLES:], target[-N_VALID_EXAMPLES:]
    )
    train_sampler = torch.utils.data.distributed.DistributedSampler(dataset=train_dataset)
    valid_sampler = torch.utils.data.distributed.DistributedSampler(
        dataset=valid_dataset, shuffle=False
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, sampler=train_sampler, batch_size=BATCHSIZE, shuffle=False
    )
    valid_loader = torch.utils.data.DataLoader(
        valid_dataset, sampler=valid_sampler, batch_size=BATCHSIZE, shuffle=False
    )
    return train_loader, valid_loader, train_sampler, valid_sampler


def objective(single_trial):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP

    trial = optuna.integration.TorchDistributedTrial(single_trial)

    model = DDP(define_model(trial))

    optimizer_name = trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
    lr = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
    optimizer = getattr(optim, optimizer_name)(model.parameters(), lr=lr)

    train_loader, valid_loader, train_sampler, valid_sampler = get_digits()  # noqa: RUF059

    accuracy = 0
    for epoch in range(EPOCHS):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()

        model.eval()
        correct = 0
        with torch.no_grad():
            for data, target in valid_loader:
                output = model(data)
                pred = output.argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()

        correct_tensor = torch.tensor([correct], dtype=torch.int)
        dist.all_reduce(correct_tensor)
        total_correct = correct_tensor.item()
        accuracy = total_correct / len(valid_loader.dataset)

        trial.report(accuracy, epoch)
        trial.set_user_attr("pid", os.getpid())  # not the example's: which process served it

        if trial.should_prune():
            raise optuna.exceptions.TrialPruned()

    return accuracy


def objective_that_starts_its_group(single_trial):  # type: ignore[no-untyped-def]
    """The same, written for clusterkit's gangs: the objective initialises its group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return objective(single_trial)


# ---------------------------------------------------------------------- the tests


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """Two workers: one gang at a time, so every trial after the first reuses its processes."""
    from tests.clusters import local_client

    with local_client(2, dashboard=True) as connected:
        yield connected


@pytest.fixture
def client(cluster: object) -> Iterator[object]:
    from tests.clusters import as_new

    with as_new(cluster, rank_processes=True) as connected:
        yield connected


@pytest.mark.parametrize(
    "function", [objective, objective_that_starts_its_group], ids=["as-in-example", "own-group"]
)
def test_optunas_distributed_example_runs_unchanged_as_gang_trials(
    client: object, function: object
) -> None:
    study = optuna.create_study(
        direction="maximize",
        storage=optuna.storages.InMemoryStorage(),
        sampler=optuna.samplers.RandomSampler(seed=5),
    )
    hpo.run(
        function,  # type: ignore[arg-type]
        n_trials=3,
        client=client,  # type: ignore[arg-type]
        study=study,
        progress=False,
        workdir=None,
        ranks_per_trial=2,
    )
    trials = study.get_trials()
    errors = [t.user_attrs.get(ATTR_ERROR) for t in trials]
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3, errors
    assert not [t.number for t in trials if ATTR_ATTEMPTS in t.user_attrs]  # each passed first
    pids = [t.user_attrs["pid"] for t in trials]
    assert len(set(pids)) < len(pids), f"no rank 0 process served two trials: {pids}"
    for trial in trials:  # the driver sampled each parameter, rank 0 reported
        assert {"n_layers", "optimizer", "lr", "n_units_l0", "dropout_l0"} <= set(trial.params)
        assert sorted(trial.intermediate_values) == [0, 1]
        assert 0.0 <= trial.value <= 1.0
