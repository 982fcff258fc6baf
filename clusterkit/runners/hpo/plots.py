"""Optuna's own plots of a study, as the results folder draws them (:mod:`.report`): those
that apply to the study (history and importances of one objective, the Pareto front of two or
three), each in plotly (the report) and matplotlib (the PNG)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from clusterkit.runners.hpo.timeline import pyplot


@contextlib.contextmanager
def each_warning_once() -> Iterator[None]:
    """Warnings raised inside, each distinct one passed on once (to the caller's filters)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    seen = set()
    for item in caught:
        key = (item.category, str(item.message))
        if key not in seen:
            seen.add(key)
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


def optuna_plots(study: Any) -> dict[str, tuple[Any, Any]]:
    """Optuna's plots that apply to the study: name -> (plotly function, matplotlib function)."""
    import warnings

    from optuna import visualization as vis
    from optuna.exceptions import ExperimentalWarning
    from optuna.trial import TrialState

    pyplot()  # the Agg backend, before optuna's matplotlib module imports pyplot
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)  # optuna's matplotlib API
        from optuna.visualization import matplotlib as vis_mpl

    def quiet(fn: Any) -> Any:
        def call(study: Any) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                return fn(study).figure

        return call

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    plots: dict[str, tuple[Any, Any]] = {}
    if complete and len(study.directions) in (2, 3):  # more: Optuna asks which to draw
        # the others take a target of one value: no history, no importances
        plots["pareto_front"] = (vis.plot_pareto_front, quiet(vis_mpl.plot_pareto_front))
    if complete and len(study.directions) == 1:
        plots["optimization_history"] = (
            vis.plot_optimization_history,
            quiet(vis_mpl.plot_optimization_history),
        )
        if len(complete) >= 2 and any(t.params for t in complete):
            plots["param_importances"] = (
                vis.plot_param_importances,
                quiet(vis_mpl.plot_param_importances),
            )
    return plots
