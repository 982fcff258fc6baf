"""torch.distributed training over any Dask Client: one rank per worker (or GPU), restarts.

The driver places ranks on workers, submits one pinned task per rank (``ddp_worker``), watches
the group and stops all of it when one rank fails or a worker leaves; with ``max_restarts`` it
starts a fresh group (fresh port, remaining or replaced workers) that resumes from the last
checkpoint rank 0 saved. Checkpoints travel through the scheduler, so no shared disk is needed.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput, ClusterkitError

if TYPE_CHECKING:
    from distributed import Client, Future

log = logging.getLogger(__name__)

WORKER_WAIT_ENV = "CLUSTERKIT_DDP_WORKER_WAIT"  # seconds to wait for enough workers (60)
_prepared: set[str] = set()


class TrainingFailed(ClusterkitError):
    """The group failed (and restarts, if any, are used up). Names the rank, keeps the trace."""

    def __init__(self, rank: int | None, message: str, tb: str = "", attempts: int = 1) -> None:
        self.rank = rank
        self.traceback = tb
        self.attempts = attempts
        where = f"rank {rank}" if rank is not None else "training"
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        super().__init__(f"{where} failed{tries}: {message}")

    def details(self) -> str:
        tail = "\n".join(f"  | {line}" for line in self.traceback.rstrip().splitlines())
        return f"{self.one_line()}\n{tail}" if tail else self.one_line()


@dataclass(frozen=True)
class Slot:
    """Where one rank runs."""

    worker: str
    host: str
    slot: int  # index among this worker's ranks (its n-th GPU)
    gpu: bool
    threads: int


class _GroupFailed(Exception):
    def __init__(self, rank: int | None, message: str, tb: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.message = message
        self.traceback = tb


def prepare(client: Client) -> None:
    """Start a spare rank process (torch imported) on every worker, now and on new workers."""
    from clusterkit.runners.ddp.worker import SparePlugin

    if client.id in _prepared:
        return
    client.register_plugin(SparePlugin(), name=SparePlugin.name)
    _prepared.add(client.id)


def wait_ready(client: Client, timeout: float = 60.0) -> None:
    """Block until every worker's spare rank process has imported torch (for benchmarks)."""
    from clusterkit.runners.ddp.worker import spare_ready

    prepare(client)
    deadline = time.monotonic() + timeout
    while not all(client.run(spare_ready).values()):
        if time.monotonic() > deadline:
            raise TimeoutError("spare rank processes not ready")
        time.sleep(0.1)


def _workers(client: Client) -> dict[str, Any]:
    """Fresh per-worker info from the scheduler.

    Not ``client.scheduler_info()``: its cached copy is overwritten every few seconds by the
    client's periodic update, which carries no workers, so reading it can race to ``{}``.
    """
    scheduler = client.scheduler
    if scheduler is None:
        raise ClusterkitError("the client is not connected to a scheduler")
    return client.sync(scheduler.identity, n_workers=-1)["workers"]


def _slots(client: Client) -> list[Slot]:
    from distributed.comm import get_address_host

    from clusterkit.capacity import ranks_per_worker

    workers = _workers(client)
    slots: list[Slot] = []
    for address in sorted(workers, key=lambda a: (get_address_host(a), a)):
        info = workers[address]
        if info.get("status", "running") not in ("running", "Status.running"):
            continue
        nthreads = int(info.get("nthreads", 1))
        gpus = int(info.get("resources", {}).get("GPU", 0))
        count = ranks_per_worker(nthreads, gpus)
        for index in range(max(count, 1)):
            threads = max(1, nthreads // count) if gpus else nthreads
            host = get_address_host(address)
            slots.append(Slot(address, host, index, bool(gpus), threads))
    return slots


def _place(client: Client, world_size: int | None, wait: float, shrink: bool = False) -> list[Slot]:
    """Slots for ``world_size`` ranks, waiting (bounded) for workers to arrive.

    ``shrink``: a restarted group whose size the user did not fix runs on the workers that
    remain when replacements do not arrive in time.
    """
    deadline = time.monotonic() + wait
    while True:
        slots = _slots(client)
        wanted = world_size or len(slots)
        if slots and len(slots) >= wanted:
            return slots[:wanted]
        if time.monotonic() > deadline:
            if shrink and slots:
                log.warning("restarting with %d ranks instead of %d", len(slots), wanted)
                return slots
            raise ClusterkitError(
                f"world size {wanted} needs {wanted} rank slots, the cluster has {len(slots)} "
                f"after waiting {wait:.0f}s",
                hint="scale the cluster up or pass a smaller world_size",
            )
        time.sleep(0.25)


def _backend(backend: str, slots: list[Slot]) -> str:
    if backend != "auto":
        return backend
    return "nccl" if all(s.gpu for s in slots) else "gloo"


def _specs(
    run_id: str, attempt: int, slots: list[Slot], backend: str, payload: bytes, **extra: Any
) -> list[dict[str, Any]]:
    key = f"{run_id}-a{attempt}"
    master = slots[0].host
    specs = []
    for rank, slot in enumerate(slots):
        local = [s for s in slots if s.host == slot.host]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(slots)),
            "LOCAL_RANK": str(local.index(slot)),
            "LOCAL_WORLD_SIZE": str(len(local)),
            "GROUP_RANK": "0",
            "MASTER_ADDR": master,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_RUN_ID": run_id,
        }
        specs.append(
            {
                "key": key,
                "run_id": run_id,
                "attempt": attempt,
                "rank": rank,
                "world_size": len(slots),
                "local_rank": local.index(slot),
                "local_world_size": len(local),
                "slot": slot.slot,
                "worker": slot.worker,
                "threads": slot.threads,
                "backend": backend,
                "env": env,
                "payload": payload,
                **extra,
            }
        )
    return specs


def _interface_env(client: Client, slots: list[Slot]) -> dict[str, dict[str, str]]:
    """GLOO/NCCL socket interface per worker: the one carrying the worker's Dask address."""
    from clusterkit.runners.ddp.worker import interface_of

    workers = sorted({s.worker for s in slots})
    found = client.run(interface_of, workers=workers)
    return {
        w: ({"GLOO_SOCKET_IFNAME": n, "NCCL_SOCKET_IFNAME": n} if n else {})
        for w, n in found.items()
    }


def _watch(
    client: Client, futures: list[Future], slots: list[Slot], deadline: float | None
) -> list[bytes]:
    """Wait for every rank; raise _GroupFailed at the first failure or lost worker."""
    last_check = time.monotonic()
    while True:
        statuses = [f.status for f in futures]
        if all(s == "finished" for s in statuses):
            return client.gather(futures)
        for rank, status in enumerate(statuses):
            if status in ("error", "cancelled", "lost"):
                raise _GroupFailed(rank, f"task {status}")
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise _GroupFailed(None, "timed out")
        if now - last_check > 1.0:
            last_check = now
            alive = set(_workers(client))
            for rank, slot in enumerate(slots):
                if slot.worker not in alive and futures[rank].status != "finished":
                    raise _GroupFailed(rank, f"worker {slot.worker} left the cluster")
        time.sleep(0.02)


def _first_failure(futures: list[Future], slots: list[Slot], alive: set[str]) -> _GroupFailed:
    """The cause: a lost worker, else the earliest real error (a peer's comes later)."""
    from clusterkit.runners.ddp.worker import RankError

    for rank, slot in enumerate(slots):
        if slot.worker not in alive:
            return _GroupFailed(rank, f"worker {slot.worker} left the cluster")
    errors = []
    for index, future in enumerate(futures):
        if future.status != "error":
            continue
        error = future.exception()
        if isinstance(error, RankError):
            if error.kind != "Aborted":
                text = f"{error.kind}: {error.message}"
                errors.append((error.time, error.rank, text, error.traceback))
        else:
            errors.append((float("inf"), index, f"{type(error).__name__}: {error}", ""))
    if not errors:
        return _GroupFailed(None, "a rank task ended without a result")
    _, first, message, tb = min(errors, key=lambda e: (e[0], e[1]))
    return _GroupFailed(first, message, tb)


def _stop(client: Client, key: str, futures: list[Future], slots: list[Slot]) -> set[str]:
    """Kill every rank process of this attempt, let the tasks settle (bounded); alive workers."""
    from distributed import wait

    from clusterkit.runners.ddp.worker import abort

    alive = set(_workers(client))
    targets = sorted({s.worker for s in slots} & alive)
    if targets:
        try:
            client.run(abort, key, workers=targets, on_error="ignore")
        except Exception as error:  # a worker dying right now must not mask the real failure
            log.warning("abort of %s failed: %s", key, error)
    running = [f for f, s in zip(futures, slots, strict=True) if s.worker in alive]
    try:
        wait(running, timeout=15)
    except TimeoutError:
        log.warning("ranks of %s still running 15s after abort", key)
    return alive


def _checkpoint(client: Client, run_id: str) -> bytes | None:
    from distributed import Event, Variable

    if not Event(f"{run_id}-ckpt", client).is_set():
        return None
    return Variable(f"{run_id}-ckpt", client=client).get()


def _cleanup(client: Client, run_id: str, attempts: int) -> None:
    from distributed import Event, Variable

    names = [f"{run_id}-ckpt"] + [f"{run_id}-a{a}-port" for a in range(attempts)]
    for name in names:
        try:
            Variable(name, client=client).delete()
            Event(name, client).clear()
        except Exception as error:  # cleanup must not hide the run's outcome
            log.debug("could not delete variable %s: %s", name, error)


def run(
    train_fn: Callable[..., Any],
    *args: Any,
    client: Client | None = None,
    world_size: int | None = None,
    backend: str = "auto",
    max_restarts: int = 0,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``train_fn(ctx, *args, **kwargs)`` on every rank of a DDP group; results by rank.

    Parameters
    ----------
    train_fn
        Called in each rank's process after ``init_process_group``; ``ctx`` gives ``rank``,
        ``world_size``, ``local_rank``, ``local_world_size``, ``device``,
        ``save_checkpoint(state)`` and ``load_checkpoint()``. The torchrun variables (RANK,
        WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are set too.
    client
        Any ``distributed.Client``; default ``clusterkit.get_client()``.
    world_size
        Number of ranks; default one per worker (one per GPU on GPU workers).
    backend
        ``"auto"`` (``nccl`` when every rank has a GPU, else ``gloo``), or a torch backend.
    max_restarts
        Times a failed group is restarted, resuming from the last checkpoint.
    timeout
        Seconds for the whole run (all attempts); None waits as long as training runs.

    Raises
    ------
    BadInput
        ``world_size`` below 1 or a negative ``max_restarts``.
    TrainingFailed
        A rank raised or its worker died and no restart is left: carries ``rank`` and
        ``traceback``.
    ClusterkitError
        Not enough workers arrived within the wait (``CLUSTERKIT_DDP_WORKER_WAIT``, 60 s).
    """
    return _run(train_fn, args, kwargs, client, world_size, backend, max_restarts, timeout, True)


def _run(
    train_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    client: Client | None,
    world_size: int | None,
    backend: str,
    max_restarts: int,
    timeout: float | None,
    init_group: bool,
) -> list[Any]:
    import cloudpickle

    if world_size is not None and world_size < 1:
        raise BadInput(f"world size must be at least 1, got {world_size}")
    if max_restarts < 0:
        raise BadInput(f"max_restarts must be 0 or more, got {max_restarts}")
    if client is None:
        from clusterkit.client import get_client

        client = get_client()
    prepare(client)
    payload = cloudpickle.dumps((train_fn, args, kwargs))
    run_id = f"clusterkit-ddp-{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + timeout if timeout else None
    wait = float(os.environ.get(WORKER_WAIT_ENV, "60"))
    checkpoint: bytes | None = None
    attempt = 0
    slots: list[Slot] = []
    try:
        while True:
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            if attempt == 0:
                slots = _place(client, world_size, wait)
            else:  # same size: wait for replacements of lost workers (elastic if size was free)
                slots = _place(client, len(slots), wait, shrink=world_size is None)
            try:
                results = _attempt(
                    client,
                    run_id,
                    attempt,
                    slots,
                    backend,
                    payload,
                    checkpoint,
                    init_group,
                    deadline,
                )
                return [cloudpickle.loads(r) for r in results]
            except _GroupFailed as failure:
                timed_out = deadline is not None and time.monotonic() > deadline
                if attempt >= max_restarts or timed_out:
                    raise TrainingFailed(
                        failure.rank, failure.message, failure.traceback, attempt + 1
                    ) from None
                log.warning("DDP attempt %d failed (%s); restarting", attempt, failure.message)
                attempt += 1
                checkpoint = _checkpoint(client, run_id)
    finally:
        _cleanup(client, run_id, attempt + 1)


def _attempt(
    client: Client,
    run_id: str,
    attempt: int,
    slots: list[Slot],
    backend: str,
    payload: bytes,
    checkpoint: bytes | None,
    init_group: bool,
    deadline: float | None,
) -> list[bytes]:
    if not any(s.gpu for s in slots):
        return _launch(
            client, run_id, attempt, slots, backend, payload, checkpoint, init_group, deadline
        )
    # GPU ranks hold the GPU resource while they wait for their peers: two runs whose ranks
    # interleave in the workers' queues would wait on each other forever, so GPU groups on one
    # cluster start one at a time (a scheduler semaphore; its lease dies with this client).
    from distributed import Semaphore

    gate = Semaphore(1, "clusterkit-ddp-gpu", scheduler_rpc=client.scheduler, loop=client.loop)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not gate.acquire(timeout=left):
        raise _GroupFailed(None, "timed out waiting for another GPU training run to finish")
    try:
        return _launch(
            client, run_id, attempt, slots, backend, payload, checkpoint, init_group, deadline
        )
    finally:
        gate.release()


def _launch(
    client: Client,
    run_id: str,
    attempt: int,
    slots: list[Slot],
    backend: str,
    payload: bytes,
    checkpoint: bytes | None,
    init_group: bool,
    deadline: float | None,
) -> list[bytes]:
    from clusterkit.runners.ddp.worker import rank_task

    chosen = _backend(backend, slots)
    interfaces = _interface_env(client, slots)
    specs = _specs(
        run_id,
        attempt,
        slots,
        chosen,
        payload,
        checkpoint=checkpoint,
        init_group=init_group,
        rendezvous_timeout=120.0,
    )
    futures = []
    for spec, slot in zip(specs, slots, strict=True):
        spec["default_env"] = interfaces.get(slot.worker, {})
        futures.append(
            client.submit(
                rank_task,
                spec,
                key=f"{spec['key']}-rank{spec['rank']}",
                workers=[slot.worker],
                allow_other_workers=False,
                pure=False,
                resources={"GPU": 1} if slot.gpu else None,
            )
        )
    try:
        return _watch(client, futures, slots, deadline)
    except _GroupFailed as failure:
        alive = _stop(client, specs[0]["key"], futures, slots)
        if failure.message == "timed out":
            raise
        raise _first_failure(futures, slots, alive) from None
    except BaseException:
        _stop(client, specs[0]["key"], futures, slots)
        raise
    finally:
        client.cancel(futures, force=True)
