"""torch.distributed training over any Dask client: ``ddp.run(train, world_size=...)``.

Modules: ``driver`` (placement, rendezvous, restarts), ``worker`` (the worker-side rank task and
its warm child process), ``rank`` (the child's entry point), ``script`` (run a torchrun-style
script), ``progress`` (rank 0's reports: ``report(epoch=..., **metrics)`` for torchrun-style
scripts, the driver's display). Public names are loaded lazily so that workers do not import
the driver.
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
    from clusterkit.runners.ddp.progress import report

__all__ = ["WORKER_WAIT_ENV", "TrainingFailed", "prepare", "report", "run", "wait_ready"]


def __getattr__(name: str) -> Any:
    if name == "report":  # the rank side's: no driver import in a rank process
        from clusterkit.runners.ddp import progress

        return progress.report
    if name in __all__:
        from clusterkit.runners.ddp import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'clusterkit.runners.ddp' has no attribute {name!r}")
