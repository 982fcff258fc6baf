"""HPO results: the live progress line, the best-trials table, and the output folder."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from clusterkit.runners.hpo import inputs

logger = logging.getLogger(__name__)


def _counts(study: Any) -> dict[str, int]:
    counts = {"COMPLETE": 0, "PRUNED": 0, "FAIL": 0}
    for trial in study.get_trials(deepcopy=False):
        if inputs.counted(trial):
            counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


def _best_text(study: Any) -> str:
    try:
        return f"{study.best_value:.5g} (#{study.best_trial.number})"
    except (ValueError, RuntimeError):
        return "-"


class ProgressDisplay:
    """A rich progress bar on stderr: done/total, running, failed, pruned, best, busy, ETA."""

    def __init__(self, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        from clusterkit.console import err

        self.progress = Progress(
            TextColumn("trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=err(),
            transient=False,
        )
        self.task = self.progress.add_task("hpo", total=total, detail="starting")
        self.progress.start()

    def update(self, study: Any, running: int, busy: int, total: int) -> None:
        counts = _counts(study)
        done = sum(counts.values())
        detail = (
            f"running {running} | failed {counts['FAIL']} | pruned {counts['PRUNED']} | "
            f"best {_best_text(study)} | workers busy {busy}"
        )
        self.progress.update(self.task, completed=done, total=total, detail=detail)

    def close(self) -> None:
        self.progress.stop()


def print_best(study: Any, top: int = 5) -> None:
    """The best completed trials as a table on stdout."""
    from optuna.trial import TrialState

    from clusterkit.console import message, table

    if len(study.directions) > 1:
        trials = study.best_trials[:top]
    else:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        reverse = study.direction.name == "MAXIMIZE"
        trials = sorted(done, key=lambda t: t.value, reverse=reverse)[:top]
    if not trials:
        message("no trial completed")
        return
    rows = [
        (
            t.number,
            ", ".join(f"{v:.5g}" for v in t.values),
            ", ".join(f"{k}={_short(v)}" for k, v in t.params.items()),
            _seconds(t),
            t.user_attrs.get(inputs.ATTR_WORKER, ""),
        )
        for t in trials
    ]
    table(f"best trials of {study.study_name}", ["#", "value", "params", "time", "worker"], rows)


def _seconds(trial: Any) -> str:
    """Run time on the worker when recorded, else the storage's ask-to-tell duration."""
    span = trial.user_attrs.get(inputs.ATTR_TIME)
    if span:
        return f"{span[1] - span[0]:.1f}s"
    return f"{trial.duration.total_seconds():.1f}s" if trial.duration else ""


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_results(study: Any, out: str | Path) -> Path:
    """``trials.csv`` and plots (optimization history, importances, timeline) as HTML and PNG."""
    import matplotlib

    if "matplotlib.pyplot" not in __import__("sys").modules:
        matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt
    from optuna import visualization as vis
    from optuna.exceptions import ExperimentalWarning
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as vis_mpl

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    study.trials_dataframe().to_csv(folder / "trials.csv", index=False)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    plots: dict[str, tuple[Any, Any]] = {}
    if complete and len(study.directions) == 1:
        plots["optimization_history"] = (
            vis.plot_optimization_history,
            vis_mpl.plot_optimization_history,
        )
        params = {k for t in complete for k in t.params}
        if len(complete) >= 2 and params:
            plots["param_importances"] = (
                vis.plot_param_importances,
                vis_mpl.plot_param_importances,
            )
    for name, (plotly_fn, mpl_fn) in plots.items():
        try:
            plotly_fn(study).write_html(folder / f"{name}.html")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)  # optuna's matplotlib API
                axes = mpl_fn(study)
            axes.figure.savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight")
            plt.close(axes.figure)
        except (ValueError, RuntimeError) as error:  # e.g. importances of constant params
            logger.warning("skipped %s: %s", name, error)
    _timeline(study, folder)
    return folder


def _timeline(study: Any, folder: Path) -> None:
    """Trials as bars per worker (the gaps are idle time), with the utilisation in the title."""
    import matplotlib.pyplot as plt
    import plotly.graph_objects as go
    from matplotlib.patches import Patch

    rows = [
        (
            t.user_attrs[inputs.ATTR_WORKER],
            t.user_attrs[inputs.ATTR_TIME][0],
            t.user_attrs[inputs.ATTR_TIME][1],
            t.number,
            t.state.name,
        )
        for t in study.get_trials(deepcopy=False)
        if inputs.ATTR_WORKER in t.user_attrs
    ]
    if not rows:
        return
    origin = min(r[1] for r in rows)
    end = max(r[2] for r in rows)
    workers = sorted({r[0] for r in rows})
    busy = sum(r[2] - r[1] for r in rows)
    span = max(end - origin, 1e-9)
    title = f"trials per worker: utilisation {busy / (len(workers) * span):.0%}"
    colors = {"COMPLETE": "#4c78a8", "PRUNED": "#f58518", "FAIL": "#e45756"}
    figure = go.Figure()
    for state, color in colors.items():
        mine = [r for r in rows if r[4] == state]
        if mine:
            figure.add_bar(
                y=[r[0] for r in mine],
                x=[r[2] - r[1] for r in mine],
                base=[r[1] - origin for r in mine],
                orientation="h",
                name=state.lower(),
                marker_color=color,
                text=[f"#{r[3]}" for r in mine],
                hovertemplate="trial %{text}: %{base:.2f}s + %{x:.2f}s<extra></extra>",
            )
    figure.update_layout(title=title, xaxis_title="seconds", barmode="overlay")
    figure.write_html(folder / "timeline.html")
    fig, axes = plt.subplots(figsize=(10, 1 + 0.5 * len(workers)))
    for row in rows:
        axes.barh(
            workers.index(row[0]),
            row[2] - row[1],
            left=row[1] - origin,
            color=colors.get(row[4], "#999999"),
        )
    axes.legend(
        handles=[Patch(color=c, label=s.lower()) for s, c in colors.items()], loc="lower right"
    )
    axes.set_yticks(range(len(workers)), workers)
    axes.set_xlabel("seconds")
    axes.set_title(title)
    fig.savefig(folder / "timeline.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def finish(study: Any, out: str | Path | None, progress: bool) -> None:
    """After a search: the results folder, if asked for, and the best trials on the terminal."""
    if out is not None:
        write_results(study, out)
    if progress:
        print_best(study)
