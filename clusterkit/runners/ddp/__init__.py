"""torch.distributed training over any Dask client: ``ddp.run(train, world_size=...)``.

Modules: ``driver`` (placement, rendezvous, restarts), ``worker`` (the worker-side rank task and
its warm child process), ``rank`` (the child's entry point), ``script`` (run a torchrun-style
script). Public names are loaded lazily so that workers do not import the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterkit.runners.ddp.driver import (
        WORKER_WAIT_ENV,
        TrainingFailed,
        prepare,
        run,
        wait_ready,
    )

__all__ = ["WORKER_WAIT_ENV", "TrainingFailed", "prepare", "run", "wait_ready"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from clusterkit.runners.ddp import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'clusterkit.runners.ddp' has no attribute {name!r}")
