"""Optuna's callbacks (``callback(study, frozen_trial)``: ``MLflowCallback``, W&B's, any other)
run on the driver, for each trial this search finished, once each, in trial-number order.

Trials end out of order on the workers; a trial's callbacks wait for every trial asked before
it. Those callbacks assume one process, which the driver is: their runs, files and connections
are made in one place, as under ``study.optimize``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from clusterkit.runners.hpo import inputs

Callback = Callable[[Any, Any], None]


class InOrder:
    """The search's trials as it asks them; each finished one handed to the callbacks when every
    trial before it has been (trials orphaned by a stop, or never started, are left out)."""

    def __init__(self, study: Any, callbacks: Sequence[Callback] = ()) -> None:
        self.study = study
        self.callbacks = list(callbacks)
        self.waiting: deque[tuple[int, int]] = deque()  # (number, trial id), in ask order
        self.storage = inputs.storage_of(study)

    def asked(self, trial: Any) -> None:
        """A trial this search asked for (numbers rise in ask order)."""
        if self.callbacks:
            self.waiting.append((trial.number, trial._trial_id))

    def deliver(self) -> None:
        """Run the callbacks for the finished trials at the head of the line, in order."""
        while self.waiting:
            frozen = self.storage.get_trial(self.waiting[0][1])
            if not frozen.state.is_finished():
                return  # a trial asked earlier still runs: the later ones wait for it
            self.waiting.popleft()  # first: a callback that raises is not called again for it
            if inputs.counted(frozen):
                for callback in self.callbacks:
                    callback(self.study, frozen)

    def finish(self) -> None:
        """At the search's end: every finished trial still waiting, in order; the rest (left
        running by a stop, enqueued again for the next run) are not this search's to report."""
        while self.waiting:
            self.deliver()
            if self.waiting:
                self.waiting.popleft()


def mlflow_callback(tracking_uri: str) -> Callback:
    """Optuna's ``MLflowCallback`` for ``tracking_uri`` (``sqlite:///DIR/mlflow.db``, a
    server's URL): each finished trial one run of the study's experiment, named by its number,
    with its parameters and value. Missing packages are bad input, before anything starts."""
    import warnings

    from clusterkit.errors import BadInput

    try:
        import mlflow  # noqa: F401 - the callback imports it only when first called
        from optuna.exceptions import ExperimentalWarning
        from optuna_integration.mlflow import MLflowCallback
    except ImportError as error:
        raise BadInput(
            f"MLflow tracking needs the packages mlflow and optuna-integration ({error.name} "
            "is not installed)",
            hint="pip install mlflow-skinny optuna-integration",
        ) from error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        return MLflowCallback(tracking_uri=tracking_uri, metric_name="value")
