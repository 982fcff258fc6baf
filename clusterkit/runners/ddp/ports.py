"""A group's rendezvous port, from rank 0's worker to the workers of the other ranks.

Rank 0's process hosts the group's TCPStore on a free port of its host; the other ranks need
that port in their environment before they start. Rank 0's worker sends it straight to the other
ranks' workers (one message each, worker to worker: 1-2 ms) and leaves it with the scheduler as
well (a Dask Variable, signalled by an Event: three round trips through the scheduler, 5-10 ms
on a busy scheduler), where a rank whose worker missed the message finds it. Every rank waits
on its own worker until one of the two has it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: the worker handler that takes a port from another worker
OP = "clusterkit_ddp_port"
#: ports kept per worker: a port may arrive before its rank's task, and several ranks of one
#: group may share a worker; the oldest go first
KEPT = 256
#: how long a rank waits for the direct message before it also asks the scheduler
DIRECT_WAIT = 0.5

_arrived: collections.OrderedDict[str, int] = collections.OrderedDict()
_changed = threading.Condition()


def install(worker: Any) -> None:
    """Let ``worker`` take ports from other workers (before any group is launched on them)."""
    worker.handlers[OP] = _arrive


def _arrive(key: str, port: int) -> None:
    with _changed:
        _arrived[key] = port
        _arrived.move_to_end(key)
        while len(_arrived) > KEPT:
            _arrived.popitem(last=False)
        _changed.notify_all()


def publish(key: str, port: int, peers: list[str]) -> None:
    """Rank 0's worker: ``port`` to the workers of the other ranks (``peers``, addresses) and to
    the scheduler."""
    from distributed import Event, Variable, get_client, get_worker

    worker = get_worker()
    others = sorted(set(peers) - {worker.address})
    if worker.address in peers:
        _arrive(key, port)
    if others:
        worker.loop.add_callback(_send, worker, others, key, port)
    client = get_client()
    Variable(f"{key}-port", client=client).set(port)
    Event(f"{key}-port", client).set()


async def _send(worker: Any, addresses: list[str], key: str, port: int) -> None:
    import asyncio

    async def one(address: str) -> None:
        try:
            await getattr(worker.rpc(address), OP)(key=key, port=port)
        except Exception as error:  # the scheduler's copy reaches that rank
            logger.debug("port of %s not sent to %s: %s", key, address, error)

    await asyncio.gather(*(one(a) for a in addresses))


def wait(key: str, timeout: float, aborted: Callable[[], bool]) -> int:
    """A rank's worker: ``key``'s port once rank 0's worker published it (bounded by
    ``timeout``; an abort ends the wait). The scheduler is asked every ``DIRECT_WAIT`` s, in
    case the direct message does not come."""
    from distributed import Event, Variable, get_client

    deadline = time.monotonic() + timeout
    while True:
        with _changed:
            if _changed.wait_for(lambda: key in _arrived, timeout=DIRECT_WAIT):
                return _arrived[key]
        client = get_client()
        if Event(f"{key}-port", client).is_set():
            return int(Variable(f"{key}-port", client=client).get())
        if aborted():
            raise RuntimeError("aborted before rendezvous")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish its port within {timeout:.0f}s")
