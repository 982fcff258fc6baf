"""Where a DDP group's ranks run: slots on workers, the rank specs, network interfaces."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clusterkit.errors import ClusterkitError

if TYPE_CHECKING:
    from distributed import Client

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """Where one rank runs."""

    worker: str
    host: str
    slot: int  # index among this worker's ranks (its n-th GPU)
    gpu: bool
    threads: int


def live_workers(client: Client) -> dict[str, Any]:
    """Fresh per-worker info from the scheduler.

    Not ``client.scheduler_info()``: its cached copy is overwritten every few seconds by the
    client's periodic update, which carries no workers, so reading it can race to ``{}``.
    """
    scheduler = client.scheduler
    if scheduler is None:
        raise ClusterkitError("the client is not connected to a scheduler")
    return client.sync(scheduler.identity, n_workers=-1)["workers"]


def rank_slots(client: Client) -> list[Slot]:
    return slots_of(live_workers(client))


def slots_of(workers: dict[str, Any]) -> list[Slot]:
    """Rank slots of the workers in scheduler info (``identity()["workers"]``), by host."""
    from distributed.comm import get_address_host

    from clusterkit.capacity import ranks_per_worker

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


def place(
    client: Client,
    world_size: int | None,
    wait: float,
    shrink: bool = False,
    avoid: frozenset[str] = frozenset(),
) -> list[Slot]:
    """Slots for ``world_size`` ranks, waiting (bounded) for workers to arrive.

    ``shrink``: a restarted group whose size the user did not fix runs on the workers that
    remain when replacements do not arrive in time. ``avoid``: workers that stopped answering
    (the scheduler may not have dropped them yet), used only when the wait runs out.
    """
    deadline = time.monotonic() + wait
    while True:
        expired = time.monotonic() > deadline
        every = rank_slots(client)
        slots = every if expired else [s for s in every if s.worker not in avoid]
        wanted = world_size or len(slots)
        if slots and len(slots) >= wanted:
            return slots[:wanted]
        if expired:
            if shrink and slots:
                log.warning("restarting with %d ranks instead of %d", len(slots), wanted)
                return slots
            raise ClusterkitError(
                f"world size {wanted} needs {wanted} rank slots, the cluster has {len(slots)} "
                f"after waiting {wait:.0f}s",
                hint="scale the cluster up or pass a smaller world_size",
            )
        time.sleep(0.25)


def torch_backend(backend: str, slots: list[Slot]) -> str:
    if backend != "auto":
        return backend
    return "nccl" if all(s.gpu for s in slots) else "gloo"


def rank_specs(
    run_id: str,
    attempt: int,
    slots: list[Slot],
    backend: str,
    payload: bytes,
    *,
    max_restarts: int = 0,
    **extra: Any,
) -> list[dict[str, Any]]:
    """One spec per slot, with torchrun's environment: each host is one of torchrun's nodes
    (its agent's group: ``GROUP_RANK`` in host order), every rank has the one role
    ``default`` (``ROLE_RANK`` = ``RANK``), restarts as ``--max-restarts``."""
    key = f"{run_id}-a{attempt}"
    master = slots[0].host
    hosts = list(dict.fromkeys(s.host for s in slots))  # in rank order, as nodes are ranked
    specs = []
    for rank, slot in enumerate(slots):
        local = [s for s in slots if s.host == slot.host]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(slots)),
            "LOCAL_RANK": str(local.index(slot)),
            "LOCAL_WORLD_SIZE": str(len(local)),
            "GROUP_RANK": str(hosts.index(slot.host)),
            "GROUP_WORLD_SIZE": str(len(hosts)),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(len(slots)),
            "MASTER_ADDR": master,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
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
                "workers": [s.worker for s in slots],  # rank 0's worker sends them its port
                "threads": slot.threads,
                "backend": backend,
                "env": env,
                "payload": payload,
                **extra,
            }
        )
    return specs


def node_facts(client: Client, slots: list[Slot]) -> dict[str, dict[str, str | None]]:
    """Per worker of ``slots``: the interface carrying its address and its host name."""
    from clusterkit.runners.ddp.worker import facts_of

    return client.run(facts_of, workers=sorted({s.worker for s in slots}))


def interface_env(
    client: Client, slots: list[Slot], facts: dict[str, dict[str, str | None]] | None = None
) -> dict[str, dict[str, str]]:
    """GLOO/NCCL socket interface per worker: the one carrying the worker's Dask address."""
    found = node_facts(client, slots) if facts is None else facts
    return {
        w: ({"GLOO_SOCKET_IFNAME": n, "NCCL_SOCKET_IFNAME": n} if (n := f["interface"]) else {})
        for w, f in found.items()
    }
