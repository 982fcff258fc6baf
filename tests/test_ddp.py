"""DDP runner on a real LocalCluster with gloo: correctness, torchrun scripts, failure, restart."""

from __future__ import annotations

import os
import re
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterkit.errors import ClusterkitError
from clusterkit.runners import ddp
from clusterkit.runners.ddp.placement import live_workers
from clusterkit.runners.ddp.script import run_file

pytestmark = pytest.mark.local

distributed = pytest.importorskip("distributed")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture(scope="module")
def cluster() -> Iterator[distributed.Client]:
    """Two workers for the tests that do not kill or add workers."""
    from tests.clusters import local_client

    with local_client(2, dashboard=True) as connected:
        yield connected


@pytest.fixture
def client(cluster: distributed.Client) -> Iterator[distributed.Client]:
    from tests.clusters import as_new

    with as_new(cluster, rank_processes=True) as connected:
        yield connected


@pytest.fixture
def own_client() -> Iterator[distributed.Client]:
    """A cluster of its own, for a test that kills a worker."""
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0"
    )
    client = distributed.Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


@pytest.fixture
def threaded_client() -> Iterator[distributed.Client]:
    """Two worker threads in this process, for a test that fails before any rank starts."""
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


# ---------------------------------------------------------------- rank functions


def all_reduce_fn(ctx, scale: float, offset: float = 0.0) -> dict:
    import torch.distributed as dist

    value = torch.tensor([scale * (ctx.rank + 1) + offset], device=ctx.device)  # NCCL: on its GPU
    dist.all_reduce(value)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "sum": value.item(),
        "env": env,
        "master": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        "backend": dist.get_backend(),
        "device": str(ctx.device),
    }


def page_faults_fn(ctx, megabytes: int) -> dict:
    """Allocate and free a 1 MiB tensor ``megabytes`` times: the page faults it took."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(megabytes):
        torch.ones(1 << 18).sum()  # 1 MiB, freed at once
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {"faults": faults, "trim": os.environ.get("MALLOC_TRIM_THRESHOLD_")}


def sampler_fn(ctx, size: int) -> list[int]:
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(list(range(size)), shuffle=True, seed=3)
    sampler.set_epoch(1)
    return list(sampler)


def failing_fn(ctx) -> None:
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    while True:  # rank 0 would wait in this collective forever without the abort
        dist.all_reduce(value)


def resumable_fn(ctx, epochs: int) -> dict:
    import torch.distributed as dist

    state = ctx.load_checkpoint() or {"epoch": 0, "total": 0.0, "ports": []}
    resumed_from = state["epoch"]
    state["ports"].append(int(os.environ["MASTER_PORT"]))
    for epoch in range(state["epoch"], epochs):
        value = torch.tensor([float(epoch)])
        dist.all_reduce(value)
        state["total"] += value.item()
        state["epoch"] = epoch + 1
        ctx.save_checkpoint(state)
        if ctx.restart_count == 0 and ctx.rank == 1 and epoch == 2:
            os.kill(os.getppid(), signal.SIGKILL)  # the Dask worker process dies mid-training
            time.sleep(30)
        time.sleep(0.1)
    return {
        "restarts": ctx.restart_count,
        "resumed_from": resumed_from,
        "total": state["total"],
        "ports": state["ports"],
    }


def reporting_fn(ctx, epochs: int) -> None:
    for epoch in range(epochs):
        time.sleep(0.3)  # longer than the worker's 0.25 s relay interval: no report is merged
        ctx.report(epoch=epoch + 1, loss=torch.tensor(1.0 / (epoch + 1)), phase="train")
        ctx.save_checkpoint({"epoch": epoch + 1})  # says what the report said: not sent again
        if ctx.rank == 1:
            ctx.report(epoch=99)  # only rank 0's reports count


def checkpointing_fn(ctx, states: list) -> None:
    for state in states:
        time.sleep(0.3)
        ctx.save_checkpoint(state)


def destroying_fn(ctx) -> int:
    """A torchrun-style ending: destroy the group, then let the DDP model go."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from clusterkit.runners.ddp import teardown

    model = DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    dist.destroy_process_group()
    del model  # its reducer lets the group go, but must not be the last to hold it
    return teardown.kept()


def late_store_fn(ctx) -> str:
    """Rank 0 ends at once; rank 1 still uses the rendezvous store a second later."""
    if ctx.rank == 0:
        return "first"
    from datetime import timedelta

    time.sleep(1.0)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = torch.distributed.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=5))
    store.set("late", "here")
    return store.get("late").decode()


# ---------------------------------------------------------------- tests


@pytest.mark.seam
def test_all_reduce_on_two_ranks(client) -> None:
    results = ddp.run(all_reduce_fn, 2.0, client=client, offset=1.0)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == (2 * 1 + 1) + (2 * 2 + 1) for r in results)
    assert results[1]["env"] == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    host, port = results[0]["master"]
    assert host == "127.0.0.1" and port > 0 and results[1]["master"] == (host, port)
    assert {r["backend"] for r in results} == {"gloo"} and results[0]["device"] == "cpu"
    # the worker's environment is untouched: the torchrun variables lived in the rank process
    assert not any("RANK" in env for env in client.run(lambda: dict(os.environ)).values())


def test_ranks_do_not_inherit_the_nannys_malloc_trim(client) -> None:
    """A nanny gives its worker MALLOC_TRIM_THRESHOLD_=65536; in a rank it would make every
    freed tensor over 128 KiB go back to the kernel (256 page faults a MiB again each time)."""
    workers = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
    assert set(workers.values()) == {"65536"}, workers  # what the ranks are started from
    results = ddp.run(page_faults_fn, 200, client=client)
    assert [r["trim"] for r in results] == [None, None], results
    # with the nanny's value: ~51,200 faults (200 x 256 pages); without: the heap is reused
    assert all(r["faults"] < 5_000 for r in results), results


def test_sampler_shards_are_disjoint_and_complete(client) -> None:
    shards = ddp.run(sampler_fn, 100, client=client)
    assert len(shards) == 2 and len(shards[0]) == len(shards[1]) == 50
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(range(100))
    assert shards[0] != sorted(shards[0])  # shuffled with the shared seed, still disjoint


TORCHRUN_SCRIPT = """
import argparse, os, sys
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--value", type=float, default=1.0)

if __name__ == "__main__":
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="env://")
    local_rank = int(os.environ["LOCAL_RANK"])
    t = torch.tensor([args.value * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    with open(f"{args.out}.{dist.get_rank()}", "w") as handle:
        handle.write(f"{dist.get_world_size()} {local_rank} {t.item()} {sys.argv[0]}")
    dist.destroy_process_group()
"""


REPORTING_SCRIPT = """
import torch.distributed as dist
from clusterkit.runners.ddp import report

dist.init_process_group("gloo")
for epoch in range(3):
    dist.barrier()
    report(epoch=epoch, loss=1.0 / (epoch + 1))
dist.destroy_process_group()
"""


def test_torchrun_script_reports_with_the_module_function(client, tmp_path: Path) -> None:
    script = tmp_path / "reporting.py"
    script.write_text(REPORTING_SCRIPT)
    received: list[dict] = []
    assert run_file(str(script), client=client, on_progress=received.append) == [None, None]
    assert received, "no progress arrived"
    epochs = [r["epoch"] for r in received]
    assert epochs == sorted(set(epochs)) and received[-1] == {"epoch": 2, "loss": 1.0 / 3}


@pytest.mark.seam
def test_torchrun_script_runs_unchanged(client, tmp_path: Path) -> None:
    script = tmp_path / "train_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = tmp_path / "out"
    results = run_file(str(script), ["--out", str(out), "--value", "1.5"], client=client)
    assert results == [None, None]
    for rank in (0, 1):
        world, local, total, argv0 = (out.parent / f"out.{rank}").read_text().split()
        assert (world, local, float(total)) == ("2", str(rank), 4.5)
        assert argv0 == str(script)  # in place: the worker sees the same directory


@pytest.mark.seam
def test_failing_rank_stops_the_group(client) -> None:
    # rank 0 would wait forever in its collective; the group must be stopped because rank 1
    # failed (its error comes back), not because the run's timeout ran out
    with pytest.raises(ddp.TrainingFailed) as info:
        ddp.run(failing_fn, client=client, timeout=120)
    assert info.value.rank == 1
    assert "ValueError: rank one is broken" in str(info.value)
    assert "failing_fn" in info.value.traceback and "raise ValueError" in info.value.traceback
    assert "timed out" not in str(info.value).lower()
    # the cluster is usable right after: nothing is left running in a collective
    assert [r["sum"] for r in ddp.run(all_reduce_fn, 1.0, client=client)] == [3.0, 3.0]


@pytest.mark.parametrize("storage", [False, True], ids=["via-scheduler", "checkpoint-dir"])
def test_killed_worker_restarts_from_checkpoint(own_client, tmp_path: Path, storage: bool) -> None:
    client = own_client
    before = set(live_workers(client))
    where = str(tmp_path / "ckpt") if storage else None
    results = ddp.run(
        resumable_fn, 6, client=client, max_restarts=1, timeout=150, checkpoint_dir=where
    )
    after = set(live_workers(client))
    assert (tmp_path / "ckpt" / "checkpoint.pt").exists() == storage
    assert before != after  # one worker was replaced by the nanny
    for result in results:
        assert result["restarts"] == 1
        assert result["resumed_from"] == 3  # epochs 0..2 were checkpointed before the kill
        assert result["total"] == sum(2.0 * e for e in range(6)), results
    ports = results[0]["ports"]
    assert len(ports) == 2 and ports[0] != ports[1]  # a fresh port for the new group


def test_killed_worker_without_restarts_fails(own_client) -> None:
    client = own_client
    with pytest.raises(ddp.TrainingFailed) as info:
        ddp.run(resumable_fn, 6, client=client, max_restarts=0, timeout=120)
    assert info.value.rank in (0, 1)


def test_concurrent_runs_use_distinct_ports(client) -> None:
    results: dict[str, list] = {}

    def one(name: str, scale: float) -> None:
        results[name] = ddp.run(all_reduce_fn, scale, client=client, timeout=120)

    threads = [threading.Thread(target=one, args=(n, s)) for n, s in (("a", 1.0), ("b", 10.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert [r["sum"] for r in results["a"]] == [3.0, 3.0]
    assert [r["sum"] for r in results["b"]] == [30.0, 30.0]
    assert results["a"][0]["master"][1] != results["b"][0]["master"][1]


def test_too_few_workers_is_a_clear_error(threaded_client, monkeypatch) -> None:
    client = threaded_client
    monkeypatch.setenv(ddp.WORKER_WAIT_ENV, "1")
    with pytest.raises(ClusterkitError, match="world size 3 needs 3 rank slots"):
        ddp.run(all_reduce_fn, 1.0, client=client, world_size=3)
    with pytest.raises(ClusterkitError, match="at least 1"):
        ddp.run(all_reduce_fn, 1.0, client=client, world_size=0)


def test_progress_reports_reach_the_driver_in_order(client) -> None:
    received: list[dict] = []
    ddp.run(reporting_fn, 4, client=client, on_progress=received.append)
    assert [(r["epoch"], r["phase"]) for r in received] == [(e, "train") for e in (1, 2, 3, 4)]
    assert [r["loss"] for r in received] == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4])


@pytest.mark.parametrize("storage", [False, True], ids=["via-scheduler", "checkpoint-dir"])
def test_each_checkpoint_reports_its_epoch_or_step(client, tmp_path: Path, storage: bool) -> None:
    received: list[dict] = []
    states = [{"epoch": 1, "model": [0.0]}, {"step": 40}, [1, 2], {"epoch": True}]
    where = str(tmp_path / "ckpt") if storage else None
    ddp.run(
        checkpointing_fn, states, client=client, checkpoint_dir=where, on_progress=received.append
    )
    assert received == [{"epoch": 1}, {"step": 40}, {"checkpoints": 3}, {"checkpoints": 4}]


def test_training_that_never_reports_sends_no_progress(client) -> None:
    received: list[dict] = []
    results = ddp.run(all_reduce_fn, 1.0, client=client, on_progress=received.append)
    assert [r["sum"] for r in results] == [3.0, 3.0] and received == []


def test_progress_lines_and_bad_metrics() -> None:
    from clusterkit.runners.ddp import progress

    assert progress.describe({"epoch": 3, "loss": 0.41234, "lr": 1e-4}) == (
        "epoch 3, loss 0.4123, lr 0.0001"
    )
    assert progress.describe({"checkpoints": 1}) == "1 checkpoint saved"
    assert progress.message(2, None, {"acc": torch.tensor(0.5)}) == {"epoch": 2, "acc": 0.5}
    with pytest.raises(TypeError, match="'weights' must be a number or a string"):
        progress.message(1, None, {"weights": torch.ones(3)})
    with pytest.raises(TypeError, match="'epoch' must be a number"):
        progress.message("one", None, {})
    ddp.report(epoch=1)  # outside a rank (plain torchrun, python script.py): nothing happens


def test_world_size_one(client) -> None:
    results = ddp.run(all_reduce_fn, 4.0, client=client, world_size=1)
    assert [r["sum"] for r in results] == [4.0]


@pytest.mark.seam
def test_a_destroyed_group_outlives_the_users_code(client) -> None:
    # freeing a Gloo group inside the user's code can deadlock torch (ddp/teardown.py)
    assert ddp.run(destroying_fn, client=client, world_size=2) == [1, 1]


def test_rank_zero_keeps_the_store_until_every_rank_is_done(client) -> None:
    assert ddp.run(late_store_fn, client=client, world_size=2) == ["first", "here"]


def _has_port_handler(dask_worker) -> bool:
    from clusterkit.runners.ddp import ports

    return ports.OP in dask_worker.handlers


def _drop_port_handler(dask_worker) -> None:
    from clusterkit.runners.ddp import ports

    del dask_worker.handlers[ports.OP]


def _publish(key: str, port: int, peers: list[str]) -> None:
    from clusterkit.runners.ddp import ports

    ports.publish(key, port, peers)


def _wait_port(key: str) -> int:
    from clusterkit.runners.ddp import ports

    return ports.wait(key, 30.0, lambda: False)


def _arrived(key: str) -> bool:
    from clusterkit.runners.ddp import ports

    return key in ports._arrived


def _exchange(client, key: str) -> int:
    """Rank 0's worker publishes a port, a rank on the other worker waits for it."""
    first, second = sorted(client.scheduler_info()["workers"])
    waiting = client.submit(_wait_port, key, workers=[second], pure=False)
    time.sleep(0.2)  # the rank waits before the port comes, as it does in a group
    client.submit(_publish, key, 4242, [first, second], workers=[first], pure=False).result(30)
    return waiting.result(30)


def test_rank_zeros_worker_sends_its_port_straight_to_the_other_ranks_workers(client) -> None:
    assert all(client.run(_has_port_handler).values())  # the spares' plugin installs it
    port = _exchange(client, "direct-a0")
    second = sorted(client.scheduler_info()["workers"])[1]
    assert port == 4242
    assert client.run(_arrived, "direct-a0", workers=[second])[second]


def test_a_worker_without_the_port_handler_gets_the_port_from_the_scheduler(client) -> None:
    second = sorted(client.scheduler_info()["workers"])[1]
    client.run(_drop_port_handler, workers=[second])
    try:
        port = _exchange(client, "fallback-a0")
        assert port == 4242
        assert not client.run(_arrived, "fallback-a0", workers=[second])[second]
        # and a whole group still meets there
        assert [r["sum"] for r in ddp.run(all_reduce_fn, 1.0, client=client, timeout=120)] == [
            3.0,
            3.0,
        ]
    finally:
        client.run(_reinstall_port_handler, workers=[second])


def _reinstall_port_handler(dask_worker) -> None:
    from clusterkit.runners.ddp import ports

    ports.install(dask_worker)


class _GraphsSeen:
    """Scheduler plugin: per graph the client sent, each rank task's restrictions."""

    name = "test-rank-graphs"

    def __init__(self) -> None:
        self.graphs: list[dict] = []

    def update_graph(self, scheduler, *, keys, tasks, **kwargs) -> None:
        ranks = {k: scheduler.tasks[k] for k in tasks if "-rank" in str(k)}
        if ranks:
            self.graphs.append(
                {
                    k: (
                        sorted(ts.worker_restrictions or ()),
                        ts.loose_restrictions,
                        ts.resource_restrictions or {},
                    )
                    for k, ts in ranks.items()
                }
            )


def _graphs_seen(dask_scheduler) -> list[dict]:
    return dask_scheduler.plugins[_GraphsSeen.name].graphs


@pytest.mark.seam
def test_a_groups_ranks_go_in_one_graph_each_pinned_to_its_slot(client) -> None:
    from distributed.diagnostics.plugin import SchedulerPlugin

    from clusterkit.runners.ddp.group import submit_ranks
    from clusterkit.runners.ddp.placement import Slot

    class Seen(_GraphsSeen, SchedulerPlugin):
        pass

    client.register_plugin(Seen())
    try:
        ranks = ddp.run(all_reduce_fn, 1.0, client=client, world_size=2, timeout=120)
        first, second = sorted(client.scheduler_info()["workers"])
        (graph,) = client.run_on_scheduler(_graphs_seen)  # one message for the whole group
        assert sorted(graph.values()) == [([first], False, {}), ([second], False, {})]
        assert [r["sum"] for r in ranks] == [3.0, 3.0]
        # GPU slots ask for a GPU each (no worker here has one: they wait, and are cancelled)
        gpu = [Slot(w, "127.0.0.1", 0, True, 1) for w in (first, second)]
        specs = [{"key": "gpu-restrictions-a0", "rank": r} for r in (0, 1)]
        futures = submit_ranks(client, specs, gpu, {})
        deadline = time.monotonic() + 30
        while len(client.run_on_scheduler(_graphs_seen)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the graph is on its way to the scheduler
        client.cancel(futures, force=True)
        _, graph = client.run_on_scheduler(_graphs_seen)
        assert sorted(graph.values()) == [([w], False, {"GPU": 1}) for w in (first, second)]
    finally:
        client.unregister_scheduler_plugin(_GraphsSeen.name)


# ---------------------------------------------------------------- CLI


def _cli(args: list[str], capsys) -> tuple[int, str]:
    from clusterkit.cli import main

    try:
        main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0), capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "extra", "needle"),
    [
        ("missing.py", [], "no such file"),
        ("{script}:nope", [], "defines no function 'nope'"),
        ("{script}", ["--world-size", "0"], "at least 1"),
        ("{script}", ["--world-size", "5", "--profile", "local"], "can provide (2 ranks)"),
        ("{script}.txt", [], "FILE.py or FILE.py:FUNC"),
    ],
)
def test_cli_bad_input(tmp_path: Path, capsys, target: str, extra: list[str], needle: str) -> None:
    script = tmp_path / "job.py"
    script.write_text("def main(ctx):\n    return ctx.rank\n")
    code, err = _cli(["train", target.format(script=script), *extra], capsys)
    assert code == 2
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_cli_runs_a_function(tmp_path: Path, capsys) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch.distributed as dist

            def main(ctx, factor):
                t = torch.tensor([float(factor) * (ctx.rank + 1)])
                dist.all_reduce(t)
                return f"sum={t.item()}"
            """
        )
    )
    from clusterkit.cli import main

    main(["train", f"{script}:main", "--profile", "local", "--", "7"])
    out = capsys.readouterr().out
    assert out.count("sum=21.0") == 2, out


def test_cli_says_a_torchrun_style_script_finished(tmp_path: Path, capsys) -> None:
    """A script that returns nothing gets one line, not a table of None per rank."""
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == dist.get_world_size()
            dist.destroy_process_group()
            """
        )
    )
    from clusterkit.cli import main

    main(["train", str(script), "--profile", "local"])
    captured = capsys.readouterr()
    assert "None" not in captured.out, captured.out
    assert "trained plain.py: 2 ranks finished\n" in captured.err  # no progress to show


TRAIN_WITH_PROGRESS = """
import time
import torch.distributed as dist
from clusterkit.runners.ddp import report

dist.init_process_group("gloo")
for epoch in range(1, 4):
    time.sleep(0.3)
    report(epoch=epoch, loss=round(1.23 / epoch, 2))
dist.destroy_process_group()
"""


def test_cli_shows_the_latest_progress(tmp_path: Path, capsys) -> None:
    script = tmp_path / "fit.py"
    script.write_text(TRAIN_WITH_PROGRESS)
    from clusterkit.cli import main

    main(["train", str(script), "--profile", "local"])
    assert "trained fit.py: 2 ranks finished (epoch 3, loss 0.41)" in capsys.readouterr().err


DETACHED_TRAIN = """
import time

def train(ctx, epochs):
    start = (ctx.load_checkpoint() or {"epoch": 0})["epoch"]
    for epoch in range(start, int(epochs)):
        time.sleep(0.4)
        ctx.save_checkpoint({"epoch": epoch + 1})
"""


def test_detached_training_records_its_epoch(tmp_path: Path, monkeypatch, capsys) -> None:
    import json

    from clusterkit import runs, state

    monkeypatch.setenv("CLUSTERKIT_DDP_SPARES", "0")  # the driver's embedded cluster ends with it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fit.py").write_text(DETACHED_TRAIN)
    run_id = runs.launch("train", ["fit.py:train", "-p", "local", "--", "5"])
    assert runs.wait(run_id, timeout=180) == 0, "".join(runs.logs(run_id))
    saved = json.loads((state.run_dir(run_id) / "progress.json").read_text())
    assert saved == {"epoch": 5}
    log = "".join(runs.logs(run_id))
    assert "[progress] epoch 5\n" in log, log
    shown = [int(n) for n in re.findall(r"\[progress\] epoch (\d+)", log)]
    assert shown == sorted(shown), log
    from clusterkit.cli import main

    capsys.readouterr()
    main(["runs", "--json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert row["id"] == run_id and row["progress"] == "epoch 5"


# ---------------------------------------------------------------- GPU tier


@pytest.mark.gpu
def test_nccl_all_reduce_on_gpus() -> None:
    from tests.conftest import gpu_skip_reason

    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    dask_cuda = pytest.importorskip("dask_cuda")
    with (
        dask_cuda.LocalCUDACluster(
            host="127.0.0.1", dashboard_address=None, resources={"GPU": 1}
        ) as cluster,
        distributed.Client(cluster) as gpu_client,
    ):
        results = ddp.run(all_reduce_fn, 1.0, client=gpu_client)
    n = len(results)
    assert {r["backend"] for r in results} == {"nccl"}
    assert all(r["device"].startswith("cuda") for r in results)
    assert all(r["sum"] == n * (n + 1) / 2 for r in results)


# ---------------------------------------------------------------- rank output


def printing_fn(ctx) -> int:
    import sys
    import warnings

    print(f"hello from {ctx.rank}", end="")  # the newline in a second write
    print()
    print(f"to stderr from {ctx.rank}", file=sys.stderr)
    warnings.warn(f"rank {ctx.rank} warns", stacklevel=1)
    return ctx.rank


def test_rank_output_reaches_the_driver_prefixed(client, capsys) -> None:
    assert ddp.run(printing_fn, client=client, workdir=None) == [0, 1]
    captured = capsys.readouterr()
    for rank in (0, 1):
        assert f"[rank{rank}]: hello from {rank}\n" in captured.out
        assert f"[rank{rank}]: to stderr from {rank}\n" in captured.err
        assert re.search(rf"^\[rank{rank}\]: .*UserWarning: rank {rank} warns$", captured.err, re.M)
    assert "raised in" not in captured.err  # each rank's warning, as it happened


def test_failed_rank_is_one_line_on_the_driver(client, capfd) -> None:
    with pytest.raises(ddp.TrainingFailed, match="rank 1 failed: ValueError: rank one is broken"):
        ddp.run(failing_fn, client=client, workdir=None)
    err = capfd.readouterr().err  # the workers' own stderr too
    assert "[rank1]: failed: ValueError: rank one is broken\n" in err
    assert "Traceback" not in err and "Compute Failed" not in err


def test_torchrun_group_and_role_variables_over_two_hosts() -> None:
    from clusterkit.runners.ddp.placement import Slot, rank_specs

    slots = [Slot(f"tcp://{host}:1{i}", host, i, False, 1) for host in ("a", "b") for i in (0, 1)]
    specs = rank_specs("run", 1, slots, "gloo", b"", max_restarts=3)
    env = [spec["env"] for spec in specs]
    assert [e["GROUP_RANK"] for e in env] == ["0", "0", "1", "1"]  # torchrun's node rank
    assert {e["GROUP_WORLD_SIZE"] for e in env} == {"2"}  # nodes
    assert [e["ROLE_RANK"] for e in env] == ["0", "1", "2", "3"]  # one role: the global rank
    assert {e["ROLE_WORLD_SIZE"] for e in env} == {"4"}
    assert {e["ROLE_NAME"] for e in env} == {"default"}  # torchrun's --role default
    assert {e["TORCHELASTIC_MAX_RESTARTS"] for e in env} == {"3"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in env} == {"1"}


LAZY_TRAIN = """
import optuna


def train(ctx):
    # Optuna's examples name optuna.integration (a lazy ModuleType subclass) in their code
    return type(optuna.integration).__name__ if ctx.rank == 0 else None
"""


def test_a_train_function_naming_a_lazy_module_ships(client, tmp_path: Path) -> None:
    """The train function goes by value with modules of any type by reference (as hpo's
    objective does); cloudpickle alone raised 'cannot pickle _IntegrationModule'."""
    import importlib
    import sys

    import cloudpickle

    (tmp_path / "lazy_train.py").write_text(LAZY_TRAIN)
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("lazy_train")
        cloudpickle.register_pickle_by_value(module)  # as a user's file is shipped
        results = ddp.run(module.train, client=client, world_size=2, workdir=None)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop("lazy_train", None)
        sys.path.remove(str(tmp_path))
    assert results == ["_IntegrationModule", None]
