"""Asynchronous Optuna search over any Dask client: ``hpo.run(objective, n_trials=...)``.

Modules: ``driver`` (the loop on the caller's side), ``worker`` (what runs in a trial's task),
``inputs`` (objective and storage references), ``report`` (tables and plots), ``gang_loop``,
``gangs`` and ``gang_rank`` (multi-rank trials: ``ranks_per_trial``). Public names are
loaded lazily so that workers importing ``worker`` do not import the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterkit.runners.hpo.driver import run
    from clusterkit.runners.hpo.gang_rank import rank_context
    from clusterkit.runners.hpo.preemption import (
        TrialInterrupted,
        checkpoint_dir,
        should_checkpoint,
    )
    from clusterkit.runners.hpo.records import best_summary

__all__ = [
    "TrialInterrupted",
    "best_summary",
    "checkpoint_dir",
    "rank_context",
    "run",
    "should_checkpoint",
]
#: Names a trial uses on its worker: loaded without the driver.
_IN_TRIALS = ("TrialInterrupted", "checkpoint_dir", "should_checkpoint")


def __getattr__(name: str) -> Any:
    if name == "rank_context":  # a rank's: no driver import in a rank process
        from clusterkit.runners.hpo.gang_rank import rank_context

        return rank_context
    if name in _IN_TRIALS:
        from clusterkit.runners.hpo import preemption

        return getattr(preemption, name)
    if name in __all__:
        from clusterkit.runners.hpo import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'clusterkit.runners.hpo' has no attribute {name!r}")
