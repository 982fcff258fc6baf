"""How a rank ends: its process groups outlive the user's code, and rank 0's rendezvous store
outlives every rank's use of it.

torch binds DDP's ``Reducer`` without releasing the GIL on destruction. When the reducer holds
the last reference to a Gloo process group (the script called ``destroy_process_group()`` and
then let its DDP model go), freeing the model joins Gloo's worker threads with the GIL held,
while a worker thread may still be destroying its last work, whose thread-local state holds a
Python object (autograd's stashed context) and so needs the GIL: both wait forever (the class
of bug in pytorch/pytorch#56297). It hangs a rank after its last step, more often under load:
a two-rank training of ``examples/ddp_project`` hung so under CPU load in 1 of 3 tries.

So a rank process keeps every group the user's code destroys: none is freed inside that code.
They go with the process (``os._exit``: no destructor runs), or after the result is sent in a
process kept for the next trial, by which time Gloo's threads have long finished their work.
Rank 0's process hosts the rendezvous store (as torchrun's agent does), so it also waits for
every rank to count itself out of that store before closing it (:func:`leave_rendezvous`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

_kept: list[Any] = []


def keep_destroyed_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep a reference to what it destroys
    (idempotent; the user's code has not imported it yet, so both names are replaced)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_clusterkit_keeps", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is not None:
            _kept.append(group)
        else:  # every group of this process, the default one among them
            registry = getattr(getattr(c10d, "_world", None), "pg_map", None)
            _kept.extend(registry if registry else [dist.group.WORLD])
        original(group)

    destroy_process_group._clusterkit_keeps = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def kept() -> int:
    """How many destroyed groups this process holds."""
    return len(_kept)


def release() -> None:
    """Let the kept groups go (a process kept warm, once its result is sent)."""
    _kept.clear()


#: The counter of ranks done with the rendezvous store, in that store.
DONE_KEY = "clusterkit/ranks-done"
#: Seconds rank 0 keeps its store open for ranks that are not done (a peer that died).
STORE_LINGER = 30.0


def leave_rendezvous(spec: dict[str, Any], store: Any) -> None:
    """Count this rank out of the rendezvous store; rank 0, whose process hosts it, closes it
    only once every rank is out (or after :data:`STORE_LINGER` s). Otherwise a rank 0 that
    ends first (nothing to reduce) resets a peer still inside ``init_process_group`` or
    ``destroy_process_group`` ("DistNetworkError: Connection reset by peer")."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    world = int(spec["world_size"])
    try:
        if store is None:
            env = spec["env"]
            address, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
            store = TCPStore(address, port, world, is_master=False, timeout=timedelta(seconds=10))
        done = store.add(DONE_KEY, 1)
        deadline = time.monotonic() + STORE_LINGER
        while spec["rank"] == 0 and done < world and time.monotonic() < deadline:
            time.sleep(0.005)
            done = store.add(DONE_KEY, 0)
    except Exception:  # rank 0 is gone (it failed, or was stopped): nobody to tell
        return
