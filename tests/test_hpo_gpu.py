"""GPU tier of the HPO runner: one trial per GPU on dask-cuda workers. Skips without a GPU."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import cloudpickle
import optuna
import pytest

from tests.conftest import gpu_skip_reason

REASON = gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
cloudpickle.register_pickle_by_value(sys.modules[__name__])
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hpo_digits_cnn.py"


def test_digits_search_runs_one_trial_per_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import clusterkit
    from clusterkit.backends.local import gpu_inventory
    from clusterkit.runners import hpo
    from clusterkit.runners.hpo.inputs import ATTR_WORKER, load_objective

    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # its sibling digits_model, as the CLI does
    gpus, _ = gpu_inventory()
    profile = tmp_path / "cuda.yaml"
    profile.write_text(
        textwrap.dedent("""
        backend: local-cuda
        protocol: tcp
        scheduler: {host: 127.0.0.1}
    """)
    )
    with clusterkit.cluster(profile) as (_, client):
        study = hpo.run(
            load_objective(f"{EXAMPLE}:objective"),
            n_trials=2 * len(gpus),
            client=client,
            storage=optuna.storages.InMemoryStorage(),
            direction="maximize",
            resources={"GPU": 1},
            progress=False,
            out=str(tmp_path / "out"),
        )
    trials = study.get_trials()
    assert len(trials) == 2 * len(gpus)
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert all(t.user_attrs["device"] == "cuda" for t in trials)
    assert len({t.user_attrs[ATTR_WORKER] for t in trials}) == len(gpus)
    assert (tmp_path / "out" / "timeline.png").is_file()


def nccl_gang_objective(trial: optuna.Trial) -> float:
    """One NCCL all-reduce per trial; records what the rank process found on arrival."""
    import torch
    import torch.distributed as dist

    from clusterkit.runners.hpo import rank_context

    ctx = rank_context()
    x = trial.suggest_float("x", 0.0, 1.0)
    found = [os.getpid(), dist.is_initialized(), os.environ.get("CUDA_VISIBLE_DEVICES")]
    dist.init_process_group(ctx.backend)
    total = torch.ones(1, device=ctx.device)
    dist.all_reduce(total)
    trial.set_user_attr("found", found)
    trial.set_user_attr("run", [ctx.backend, str(ctx.device), total.item(), ctx.world_size])
    return x


def test_gang_trials_on_gpus_use_nccl_and_reuse_rank_processes(tmp_path: Path) -> None:
    """Gangs of every GPU (one on a one-GPU machine, through the gang path all the same):
    NCCL, each rank on its own GPU, and warm rank processes serving later trials clean."""
    import clusterkit
    from clusterkit.backends.local import gpu_inventory
    from clusterkit.runners import hpo

    gpus, _ = gpu_inventory()
    profile = tmp_path / "cuda.yaml"
    profile.write_text("backend: local-cuda\nprotocol: tcp\nscheduler: {host: 127.0.0.1}\n")
    world = len(gpus)
    with clusterkit.cluster(profile) as (_, client):
        study = hpo.run(
            nccl_gang_objective,
            n_trials=4,
            client=client,
            storage=optuna.storages.InMemoryStorage(),
            ranks_per_trial=lambda params: world,  # a function: the gang path even for 1 GPU
            progress=False,
            workdir=None,
        )
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    for trial in trials:
        backend, device, total, size = trial.user_attrs["run"]
        assert (backend, size, total) == ("nccl", world, float(world))
        assert device.startswith("cuda"), device
        assert trial.user_attrs["found"][1] is False  # no process group left by the last trial
    pids = [t.user_attrs["found"][0] for t in trials]
    assert len(set(pids)) < len(pids), f"no rank 0 process served two trials: {pids}"
