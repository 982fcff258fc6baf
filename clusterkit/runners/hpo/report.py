"""HPO results: the live progress line, the best-trials table, and the output folder.

The folder holds ``trials.csv``, each plot as PNG and one offline ``report.html`` with every plot.
"""

from __future__ import annotations

import logging
import sys
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


#: The results folder's plots, in report order: name -> heading.
HEADINGS = {
    "optimization_history": "Optimization history",
    "param_importances": "Parameter importances",
    "timeline": "Trials per worker",
}
_COLORS = {"COMPLETE": "#4c78a8", "PRUNED": "#f58518", "FAIL": "#e45756"}


def write_results(study: Any, out: str | Path) -> Path:
    """``trials.csv``, each plot as PNG, and one ``report.html`` holding every plot.

    The report inlines one copy of plotly.js, shared by its plots: it opens offline.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    study.trials_dataframe().to_csv(folder / "trials.csv", index=False)
    figures: dict[str, Any] = {}
    for name, (plotly_fn, mpl_fn) in _optuna_plots(study).items():
        try:
            figure = plotly_fn(study)
            _save_png(mpl_fn(study), folder / f"{name}.png")
            figures[name] = figure
        except (ValueError, RuntimeError) as error:  # e.g. importances of constant params
            logger.warning("skipped %s: %s", name, error)
    timeline = timeline_plotly(study)
    if timeline is not None:
        figures["timeline"] = timeline
        _save_png(timeline_matplotlib(study), folder / "timeline.png")
    (folder / "report.html").write_text(report_html(study, figures), encoding="utf-8")
    return folder


def _optuna_plots(study: Any) -> dict[str, tuple[Any, Any]]:
    """Optuna's plots that apply to the study: name -> (plotly function, matplotlib function)."""
    import warnings

    from optuna import visualization as vis
    from optuna.exceptions import ExperimentalWarning
    from optuna.trial import TrialState

    _pyplot()  # the Agg backend, before optuna's matplotlib module imports pyplot
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


def _pyplot() -> Any:
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _save_png(figure: Any, path: Path) -> None:
    try:
        figure.savefig(path, dpi=110, bbox_inches="tight")  # "tight" keeps outside legends
    finally:
        _pyplot().close(figure)


def report_html(study: Any, figures: dict[str, Any]) -> str:
    """One self-contained page: a summary, then each plotly figure under its heading.

    The first figure carries plotly.js inline and the others use it, so the page needs no network.
    """
    import html

    counts = _counts(study)
    name = html.escape(str(study.study_name))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8"><title>'
        f"{name}: HPO results</title>"
        "<style>body{font-family:sans-serif;margin:1em 2em}h2{margin-top:1.5em}</style></head>",
        f"<body><h1>Study {name}</h1>",
        f"<p>{counts['COMPLETE']} complete, {counts['PRUNED']} pruned, {counts['FAIL']} failed;"
        f" best {html.escape(_best_text(study))}."
        ' Every trial: <a href="trials.csv">trials.csv</a>.</p>',
    ]
    if not figures:
        parts.append("<p>No plot: no trial completed or recorded its worker.</p>")
    for index, (key, figure) in enumerate(figures.items()):
        parts.append(f"<h2>{html.escape(HEADINGS.get(key, key))}</h2>")
        parts.append(
            figure.to_html(
                full_html=False,
                include_plotlyjs=index == 0,
                include_mathjax=False,
                div_id=key,
                default_height="480px",
            )
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _timeline_rows(study: Any) -> list[tuple[str, float, float, int, str]]:
    """(worker, start, end, number, state) of each trial that recorded where it ran."""
    return [
        (
            t.user_attrs[inputs.ATTR_WORKER],
            t.user_attrs[inputs.ATTR_TIME][0],
            t.user_attrs[inputs.ATTR_TIME][1],
            t.number,
            t.state.name,
        )
        for t in study.get_trials(deepcopy=False)
        if inputs.ATTR_WORKER in t.user_attrs and inputs.ATTR_TIME in t.user_attrs
    ]


def _timeline_title(rows: list[tuple[str, float, float, int, str]]) -> str:
    """The title, with the utilisation: busy time over (workers x wall time)."""
    workers = {r[0] for r in rows}
    busy = sum(r[2] - r[1] for r in rows)
    span = max(max(r[2] for r in rows) - min(r[1] for r in rows), 1e-9)
    return f"trials per worker: utilisation {busy / (len(workers) * span):.0%}"


def timeline_plotly(study: Any) -> Any:
    """Trials as bars per worker (the gaps are idle time), a plotly figure; None without rows."""
    import plotly.graph_objects as go

    rows = _timeline_rows(study)
    if not rows:
        return None
    origin = min(r[1] for r in rows)
    figure = go.Figure()
    for state, color in _COLORS.items():
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
    workers = len({r[0] for r in rows})
    figure.update_layout(
        title=_timeline_title(rows),
        xaxis_title="seconds",
        barmode="overlay",
        height=max(320, 160 + 40 * workers),
    )
    return figure


def timeline_matplotlib(study: Any) -> Any:
    """The timeline as a matplotlib figure, its legend right of the axes; None without rows."""
    from matplotlib.patches import Patch

    rows = _timeline_rows(study)
    if not rows:
        return None
    origin = min(r[1] for r in rows)
    workers = sorted({r[0] for r in rows})
    fig, axes = _pyplot().subplots(figsize=(10, 1 + 0.5 * len(workers)))
    for row in rows:
        axes.barh(
            workers.index(row[0]),
            row[2] - row[1],
            left=row[1] - origin,
            color=_COLORS.get(row[4], "#999999"),
        )
    axes.legend(
        handles=[Patch(color=c, label=s.lower()) for s, c in _COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
    axes.set_yticks(range(len(workers)), workers)
    axes.set_xlabel("seconds")
    axes.set_title(_timeline_title(rows))
    return fig


def finish(study: Any, out: str | Path | None, progress: bool) -> None:
    """After a search: the results folder, if asked for, and the best trials on the terminal."""
    if out is not None:
        write_results(study, out)
    if progress:
        print_best(study)
