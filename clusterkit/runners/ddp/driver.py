"""torch.distributed training over any Dask Client: one rank per worker (or GPU), restarts.

The driver places ranks on workers, submits one pinned task per rank (``ddp_worker``), watches
the group and stops all of it when one rank fails or a worker leaves; with ``max_restarts`` it
starts a fresh group (fresh port, remaining or replaced workers) that resumes from the last
checkpoint rank 0 saved: in ``checkpoint_dir`` (any fsspec URL) when given, else held by the
scheduler (small state only). Ranks run inside the project directory (``workdir``). Rank 0's
progress reports reach ``on_progress`` as Dask events (see ``progress``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput, ClusterkitError, fit
from clusterkit.runners.ddp import group
from clusterkit.runners.ddp.placement import (
    Slot,
    interface_env,
    node_facts,
    place,
    rank_specs,
    torch_backend,
)

if TYPE_CHECKING:
    from distributed import Client, Future

    from clusterkit.runners.ddp.output import Printer
    from clusterkit.runners.ddp.progress import Progress
    from clusterkit.runners.workdir import Project

log = logging.getLogger(__name__)

WORKER_WAIT_ENV = "CLUSTERKIT_DDP_WORKER_WAIT"  # seconds to wait for enough workers (60)
_prepared: dict[str, set[str]] = {}  # client id -> the modules its spares were asked to import


class TrainingFailed(ClusterkitError):
    """The group failed (and restarts, if any, are used up). Names the rank, keeps the trace."""

    def __init__(self, rank: int | None, message: str, tb: str = "", attempts: int = 1) -> None:
        self.rank = rank
        self.traceback = tb
        self.attempts = attempts
        where = f"rank {rank}" if rank is not None else "training"
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        super().__init__(fit(f"{where} failed{tries}: {message}", 1000))


def prepare(client: Client, imports: tuple[str, ...] = ()) -> None:
    """Start a spare rank process (torch imported) on every worker, now and on new workers;
    spares import ``imports`` too (a runner's rank code), those started from now on."""
    from clusterkit.runners.ddp.pool import SparePlugin, preload

    asked = _prepared.get(client.id)
    if asked is None:
        client.register_plugin(SparePlugin(imports), name=SparePlugin.name)
    elif not asked.issuperset(imports):  # the plugin is up: the workers import more
        client.run(preload, list(imports))
    _prepared.setdefault(client.id, set()).update(imports)


def wait_ready(client: Client, timeout: float = 60.0) -> None:
    """Block until every worker's spare rank process has imported torch (for benchmarks)."""
    from clusterkit.runners.ddp.pool import spare_ready

    prepare(client)
    deadline = time.monotonic() + timeout
    while not all(client.run(spare_ready).values()):
        if time.monotonic() > deadline:
            raise TimeoutError("spare rank processes not ready")
        time.sleep(0.1)


def last_checkpoint(client: Client, run_id: str) -> bytes | None:
    """The checkpoint rank 0 of run ``run_id`` left with the scheduler, or None."""
    from distributed import Event, Variable

    if not Event(f"{run_id}-ckpt", client).is_set():
        return None
    return Variable(f"{run_id}-ckpt", client=client).get()


def cleanup(client: Client, run_id: str, attempts: int) -> None:
    """Delete the run's checkpoint and its attempts' rendezvous ports on the scheduler, in one
    round trip (one after another, a gang search's last cleanups held its return up to 1 s)."""
    from distributed import Variable

    names = [f"{run_id}-ckpt"] + [f"{run_id}-a{a}-port" for a in range(attempts)]
    try:
        for name in names:
            Variable(name, client=client).delete()  # a message, not waited for
        client.sync(_clear_events, client, names)
    except Exception as error:  # cleanup must not hide the run's outcome
        log.debug("could not delete the scheduler state of %s: %s", run_id, error)


async def _clear_events(client: Client, names: list[str]) -> None:
    """``Event(name).clear()`` for every name at once: events no one waits on are deleted."""
    scheduler: Any = client.scheduler
    await asyncio.gather(*(scheduler.event_clear(name=name) for name in names))


class Leftovers:
    """What ended groups leave behind, let go after the next launch (:meth:`let_go`): their
    futures, whose release message sent first would hold the next launch's graph for the
    client's batching interval (10 ms), and their scheduler state (:func:`cleanup`, on a thread
    of its own)."""

    def __init__(self, client: Client) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.client = client
        self.futures: list[Future] = []
        self.runs: list[tuple[str, int]] = []
        self.janitor = ThreadPoolExecutor(1, thread_name_prefix="clusterkit-gang-cleanup")

    def keep(self, futures: list[Future], run_id: str | None, attempts: int) -> None:
        """Hold ``futures``, and ``run_id``'s state of ``attempts`` attempts (None: none)."""
        self.futures.extend(futures)
        if run_id is not None:
            self.runs.append((run_id, attempts))

    def let_go(self) -> None:
        self.futures.clear()
        for run_id, attempts in self.runs:
            self.janitor.submit(cleanup, self.client, run_id, attempts)
        self.runs.clear()

    def close(self) -> None:
        self.let_go()
        self.janitor.shutdown(wait=True)


@dataclass(frozen=True)
class RunOptions:
    """How a group runs; everything but the function and its arguments."""

    world_size: int | None = None
    backend: str = "auto"
    max_restarts: int = 0
    timeout: float | None = None
    init_group: bool = True  # False for torchrun-style scripts that call init_process_group
    project: Project | None = None
    checkpoint_dir: str | None = None
    on_progress: Callable[[Progress], None] | None = None
    printer: Printer | None = None  # the ranks' lines on this process's stdout and stderr


def run(
    train_fn: Callable[..., Any],
    *args: Any,
    client: Client | None = None,
    world_size: int | None = None,
    backend: str = "auto",
    max_restarts: int = 0,
    timeout: float | None = None,
    workdir: str | os.PathLike[str] | Project | None = "auto",
    checkpoint_dir: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    stream_output: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``train_fn(ctx, *args, **kwargs)`` on every rank of a DDP group; results by rank.

    Parameters
    ----------
    train_fn
        Called in each rank's process after ``init_process_group``; ``ctx`` gives ``rank``,
        ``world_size``, ``local_rank``, ``local_world_size``, ``device``, ``save_checkpoint``,
        ``load_checkpoint`` and ``report(epoch=, **metrics)``; torchrun's variables are set.
    client
        Any ``distributed.Client``; default ``clusterkit.get_client()``.
    world_size
        Number of ranks; default one per worker (one per GPU on GPU workers).
    backend
        ``"auto"`` (``nccl`` when every rank has a GPU, else ``gloo``), or a torch backend.
    max_restarts, timeout
        Restarts of a failed group (from the last checkpoint); seconds for all attempts.
    workdir
        The project directory ranks run in (working directory, first on ``sys.path``): in
        place where a worker sees it at the same path, else a synced copy. ``"auto"``: the
        current directory when ``train_fn``'s module lives under it; None: off.
    checkpoint_dir
        fsspec URL or path (``s3://bucket/run``, a shared directory) for ``ctx``'s checkpoints;
        a later run resumes from them. Without it they pass through the scheduler (<= 64 MiB).
    on_progress
        Called with each of rank 0's reports (``ctx.report``, a checkpoint's ``epoch``/``step``)
        as a dict, in order, on the client's event-loop thread: keep it quick.
    stream_output
        The ranks' lines on this process's stdout/stderr, ``[rank1]: ...``, as torchrun tees
        them (default); False: in the workers' logs, each warning shown once at the end.

    Raises
    ------
    BadInput
        ``world_size`` below 1, a negative ``max_restarts``, a workdir over its size cap.
    TrainingFailed
        A rank raised or its worker died, no restart left: carries ``rank``, ``traceback``.
    ClusterkitError
        Not enough workers arrived within the wait (``CLUSTERKIT_DDP_WORKER_WAIT``, 60 s).
    """
    from clusterkit.runners import workdir as project_dir
    from clusterkit.runners.ddp.output import printer_for

    project, echo = project_dir.resolve(workdir, train_fn), printer_for(stream_output)
    options = RunOptions(world_size, backend, max_restarts, timeout, project=project, printer=echo)
    options = dataclasses.replace(options, checkpoint_dir=checkpoint_dir, on_progress=on_progress)
    return run_group(train_fn, args, kwargs, client, options)


def run_group(
    train_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    client: Client | None,
    options: RunOptions,
) -> list[Any]:
    """``run`` with its options gathered (``script.run_file`` enters here too)."""
    import cloudpickle

    if options.world_size is not None and options.world_size < 1:
        raise BadInput(f"world size must be at least 1, got {options.world_size}")
    if options.max_restarts < 0:
        raise BadInput(f"max_restarts must be 0 or more, got {options.max_restarts}")
    if options.checkpoint_dir and "://" not in options.checkpoint_dir:  # ranks' cwd differs
        absolute = os.path.abspath(os.path.expanduser(options.checkpoint_dir))
        options = dataclasses.replace(options, checkpoint_dir=absolute)
    if client is None:
        from clusterkit.client import get_client

        client = get_client()
    prepare(client)
    if options.project is not None:
        from clusterkit.runners.workdir import ship

        ship(client, options.project)
    from clusterkit.runners.ddp import output
    from clusterkit.runners.ddp.progress import subscribed
    from clusterkit.runners.workdir import pickling
    from clusterkit.runners.workdir.once import Collector

    payload = pickling.dumps((train_fn, args, kwargs))
    run_id = f"clusterkit-ddp-{uuid.uuid4().hex[:12]}"
    attempts = [0]
    # streamed: warnings are lines of the ranks' stderr; else shown once each, counted
    raised = None if options.printer else Collector(client, f"{run_id}-warnings")
    try:
        with (
            subscribed(client, f"{run_id}-progress", options.on_progress),
            output.subscribed(client, f"{run_id}-output", options.printer),
        ):
            results = _attempts(client, run_id, payload, options, attempts)
    finally:
        cleanup(client, run_id, attempts[0] + 1)
        if raised is not None:
            raised.summary("ranks")
    return [cloudpickle.loads(r) for r in results]


def _attempts(
    client: Client, run_id: str, payload: bytes, options: RunOptions, counter: list[int]
) -> list[bytes]:
    """Run the group, restarting it up to ``max_restarts`` times; ``counter[0]``: attempt."""
    deadline = time.monotonic() + options.timeout if options.timeout else None
    wait = float(os.environ.get(WORKER_WAIT_ENV, "60"))
    checkpoint: bytes | None = None
    slots: list[Slot] = []
    avoid: frozenset[str] = frozenset()  # workers that stopped answering: not yet dropped
    while True:
        attempt = counter[0]
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        if attempt == 0:
            slots = place(client, options.world_size, wait)
        else:  # same size: wait for replacements of lost workers (elastic if size was free)
            shrink = options.world_size is None
            slots = place(client, len(slots), wait, shrink=shrink, avoid=avoid)
        launch = _Launch(client, run_id, attempt, slots, payload, checkpoint, options, deadline)
        try:
            return _attempt(launch)
        except group.GroupFailed as failure:
            avoid = failure.unreachable
            timed_out = deadline is not None and time.monotonic() > deadline
            if attempt >= options.max_restarts or timed_out:
                raise TrainingFailed(
                    failure.rank, failure.message, failure.traceback, attempt + 1
                ) from None
            log.warning("DDP attempt %d failed (%s); restarting", attempt, failure.message)
            if avoid:
                log.warning(
                    "waiting for the scheduler to drop %d worker(s) that stopped answering",
                    len(avoid),
                )
                group.settle(client, avoid)
            counter[0] += 1
            checkpoint = last_checkpoint(client, run_id)
            if options.project is not None:  # the project as it is now, as torchrun would
                from clusterkit.runners.workdir import reship

                options = dataclasses.replace(options, project=reship(client, options.project))


@dataclass(frozen=True)
class _Launch:
    client: Client
    run_id: str
    attempt: int
    slots: list[Slot]
    payload: bytes
    checkpoint: bytes | None
    options: RunOptions
    deadline: float | None


def _attempt(launch: _Launch) -> list[bytes]:
    if not any(s.gpu for s in launch.slots):
        return _launch(launch)
    # GPU ranks hold the GPU resource while they wait for their peers: two runs whose ranks
    # interleave in the workers' queues would wait on each other forever, so GPU groups on one
    # cluster start one at a time (a scheduler semaphore; its lease dies with this client).
    from distributed import Semaphore

    client, deadline = launch.client, launch.deadline
    gate = Semaphore(1, "clusterkit-ddp-gpu", scheduler_rpc=client.scheduler, loop=client.loop)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not gate.acquire(timeout=left):
        raise group.GroupFailed(None, "timed out waiting for another GPU training run to finish")
    try:
        return _launch(launch)
    finally:
        gate.release()


def _launch(launch: _Launch) -> list[bytes]:
    client, slots, options = launch.client, launch.slots, launch.options
    facts = node_facts(client, slots)
    interfaces = interface_env(client, slots, facts)
    nodes = {worker: found["node"] for worker, found in facts.items()}
    streamed = options.printer is not None
    specs = rank_specs(
        launch.run_id,
        launch.attempt,
        slots,
        torch_backend(options.backend, slots),
        launch.payload,
        max_restarts=options.max_restarts,
        checkpoint=launch.checkpoint,
        init_group=options.init_group,
        rendezvous_timeout=120.0,
        project=options.project,
        checkpoint_dir=options.checkpoint_dir,
        warnings_topic=None if streamed else f"{launch.run_id}-warnings",
        output_topic=f"{launch.run_id}-output" if streamed else None,
        progress_topic=f"{launch.run_id}-progress" if options.on_progress else None,
    )
    futures = group.submit_ranks(client, specs, slots, interfaces)
    try:
        return group.watch(client, futures, slots, launch.deadline, nodes)
    except group.GroupFailed as failure:
        alive, unreachable = group.stop(client, specs[0]["key"], futures, slots)
        if failure.message == "timed out":
            raise
        cause = group.first_failure(futures, slots, alive, nodes, unreachable)
        cause.unreachable = unreachable
        raise cause from None
    except BaseException:
        group.stop(client, specs[0]["key"], futures, slots)
        raise
    finally:
        client.cancel(futures, force=True)
