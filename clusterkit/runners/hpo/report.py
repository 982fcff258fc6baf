"""HPO results: the live progress line, the best-trials table, and the output folder.

The folder holds ``trials.csv``, each plot as PNG, one offline ``report.html`` with every plot,
and ``account.json``: the hours the search held and where they went (:mod:`.account`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clusterkit.runners.hpo import inputs, timeline
from clusterkit.runners.hpo.inputs import ATTR_GANG
from clusterkit.runners.hpo.plots import each_warning_once, optuna_plots
from clusterkit.runners.hpo.timeline import pyplot, timeline_matplotlib, timeline_plotly

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


def _best_html(study: Any) -> str:
    """The report's best: ``best 0.125 (#3)``, or the Pareto front's size and trials."""
    if len(study.directions) == 1:
        return f"best {_best_text(study)}"
    front = best_trials(study, None)
    shown = ", ".join(f"#{t.number}" for t in front[:20]) + (", ..." if len(front) > 20 else "")
    return f"the Pareto front: {len(front)} trials" + (f" ({shown})" if front else "")


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
        self.ledger: Any = None  # the search's account of the hours (set by the driver)
        self._hours_at, self._hours_text = -1e9, ""

    def update(self, study: Any, running: int, busy: int, total: int, queued: int = 0) -> None:
        """A single-rank search: trials running (and queued ahead on workers), workers busy."""
        ahead = f" (+{queued} queued)" if queued else ""
        self._show(study, total, f"running {running}{ahead}", f"workers busy {busy}")

    def update_gangs(
        self, study: Any, total: int, sizes: list[int], slots: int, next_size: int | None
    ) -> None:
        """A gang search: the running gangs' ``sizes``, the size of the trial first in line."""
        self._show(study, total, *gang_occupancy(sizes, slots, next_size))

    def _show(self, study: Any, total: int, running: str, load: str) -> None:
        counts = _counts(study)
        detail = (
            f"{running} | failed {counts['FAIL']} | pruned {counts['PRUNED']} | "
            f"best {_best_text(study)} | {load}{self.hours_text()}"
        )
        self.progress.update(self.task, completed=sum(counts.values()), total=total, detail=detail)

    def hours_text(self) -> str:
        """The hours' account so far (:func:`.account.so_far`), at most once a second anew."""
        import time

        if self.ledger is not None and time.monotonic() - self._hours_at >= 1.0:
            from clusterkit.runners.hpo.account import so_far

            self._hours_at, self._hours_text = time.monotonic(), so_far(self.ledger)
        return self._hours_text

    def close(self) -> None:
        self.progress.stop()


def gang_occupancy(sizes: list[int], slots: int, next_size: int | None) -> tuple[str, str]:
    """How gangs hold the slots, the progress line's head and tail: ("gangs 3 running (4+2x1
    ranks)", "slots 6/8 busy | next in line: k=4"); equal sizes are counted (2x1: two of 1)."""
    counted = Counter(sizes)
    terms = [f"{size}" if n == 1 else f"{n}x{size}" for size, n in sorted(counted.items())[::-1]]
    ranks = f" ({'+'.join(terms)} ranks)" if terms else ""
    load = f"slots {sum(sizes)}/{slots} busy"
    if next_size is not None:
        load += f" | next in line: k={next_size}"
    return f"gangs {len(sizes)} running{ranks}", load


def best_trials(study: Any, top: int | None = 5) -> list[Any]:
    """The ``top`` best completed trials, best first (None: all); multi-objective, the Pareto
    front's, in trial order."""
    from optuna.trial import TrialState

    if len(study.directions) > 1:
        return sorted(study.best_trials, key=lambda t: t.number)[:top]
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    reverse = study.direction.name == "MAXIMIZE"
    return sorted(done, key=lambda t: t.value, reverse=reverse)[:top]


def print_best(study: Any, top: int = 5) -> None:
    """The best completed trials as a table on stderr, with the progress display (stdout is
    for the data: the CLI's ``best:`` line or ``--json``)."""
    from rich.markup import escape
    from rich.table import Table

    from clusterkit.console import err

    trials = best_trials(study, top)
    if not trials:
        err().print("no trial completed")
        return
    grid = Table(title=f"best trials of {escape(study.study_name)}", title_justify="left")
    for column in ("#", "value", "params", "time", "worker"):
        grid.add_column(column, header_style="bold")
    for t in trials:
        values = ", ".join(f"{v:.5g}" for v in t.values)
        params = escape(", ".join(f"{k}={_short(v)}" for k, v in t.params.items()))
        worker = escape(str(t.user_attrs.get(inputs.ATTR_WORKER, "")))
        grid.add_row(str(t.number), values, params, duration_text(seconds(t)), worker)
    err().print(grid)


def summary(study: Any, top: int = 5) -> dict[str, Any]:
    """The search's result as data (``--json``): the study, how its trials ended, the best
    trial (None when none completed, or multi-objective) and the ``top`` best (multi-objective:
    the whole Pareto front, in trial order)."""

    def trial(t: Any) -> dict[str, Any]:
        values = {"value": t.value} if len(t.values) == 1 else {"values": list(t.values)}
        worker = t.user_attrs.get(inputs.ATTR_WORKER)
        return {"number": t.number, **values, "params": t.params, "seconds": seconds(t)} | (
            {"worker": worker} if worker else {}
        )

    several = len(study.directions) > 1
    best = [trial(t) for t in best_trials(study, None if several else top)]
    counts = {state.lower(): n for state, n in _counts(study).items()}
    directions = [d.name.lower() for d in study.directions]
    return {
        "study": study.study_name,
        "directions": directions,
        "trials": counts,
        "best": best[0] if best and len(directions) == 1 else None,
        "best_trials": best,
    }


def seconds(trial: Any) -> float | None:
    """Run time on the worker when recorded, else the storage's ask-to-tell duration."""
    span = trial.user_attrs.get(inputs.ATTR_TIME)
    if span:
        return float(span[1] - span[0])
    return trial.duration.total_seconds() if trial.duration else None


def duration_text(span: float | None) -> str:
    """``850 ms``, ``1.3 s``, ``2 min 5 s``: three figures at most, never a bare 0.0 s."""
    if span is None:
        return ""
    if span < 1.0:
        return f"{span * 1000:.3g} ms"
    if span < 60.0:
        return f"{span:.3g} s"
    minutes, rest = divmod(round(span), 60)
    return f"{minutes} min {rest} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


#: The results folder's plots, in report order: name -> heading.
HEADINGS = {
    "optimization_history": "Optimization history",
    "param_importances": "Parameter importances",
    "pareto_front": "Pareto front",
    "timeline": "Trials per worker",
    "hours": "Where the hours went",
}


def write_results(study: Any, out: str | Path, ledger: Any = None) -> Path:
    """``trials.csv``, each plot as PNG, one ``report.html`` holding every plot, and, given
    the search's :class:`.account.Ledger`, ``account.json``.

    The report inlines one copy of plotly.js, shared by its plots: it opens offline.
    """
    from clusterkit.runners.hpo import account

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    study.trials_dataframe().to_csv(folder / "trials.csv", index=False)
    figures: dict[str, Any] = {}
    with each_warning_once():  # both renderings of a plot compute it: the same warnings twice
        for name, (plotly_fn, mpl_fn) in optuna_plots(study).items():
            try:
                figure = plotly_fn(study)
                _save_png(mpl_fn(study), folder / f"{name}.png")
                figures[name] = figure
            except (ValueError, RuntimeError) as error:  # e.g. importances of constant params
                logger.warning("skipped %s: %s", name, error)
    split = ledger.account() if ledger is not None else None
    lost = [s for s in ledger.segments if s.outcome == "lost"] if ledger is not None else []
    timeline_figure = timeline_plotly(study, lost)
    if timeline_figure is not None:
        figures["timeline"] = timeline_figure
        _save_png(timeline_matplotlib(study, lost), folder / "timeline.png")
    if split is not None and split.held > 0:
        account.write(split, folder)
        figures["hours"] = timeline.hours_plotly(split)
        _save_png(timeline.hours_matplotlib(split), folder / "hours.png")
    (folder / "report.html").write_text(report_html(study, figures, split), encoding="utf-8")
    return folder


def _save_png(figure: Any, path: Path) -> None:
    try:
        figure.savefig(path, dpi=110, bbox_inches="tight")  # "tight" keeps outside legends
    finally:
        pyplot().close(figure)


def report_html(study: Any, figures: dict[str, Any], split: Any = None) -> str:
    """One self-contained page: a summary (the hours' account, given one), then each plotly
    figure under its heading.

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
        f" {html.escape(_best_html(study))}."
        ' Every trial: <a href="trials.csv">trials.csv</a>.</p>',
    ]
    if split is not None and split.held > 0:
        from clusterkit.runners.hpo.account import line

        parts.append(
            f'<p id="account">{html.escape(line(split))}'
            ' (<a href="account.json">account.json</a>).</p>'
        )
    parts += _gangs_html(study)
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


def _gangs_html(study: Any) -> list[str]:
    """In a gang search: how many trials of each size, and a folded table of the workers each
    trial held (rank order); nothing otherwise."""
    import html

    held = [
        (t.number, t.state.name.lower(), t.user_attrs[ATTR_GANG])
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get(ATTR_GANG)
    ]
    if not held:
        return []
    sizes = Counter(len(workers) for _, _, workers in held)
    counts = ", ".join(f"{n} of k={k}" for k, n in sorted(sizes.items()))
    rows = "".join(
        f"<tr><td>#{number}</td><td>{len(workers)}</td><td>{state}</td>"
        f"<td>{html.escape(', '.join(workers))}</td></tr>"
        for number, state, workers in held
    )
    return [
        f"<p>Gangs of k ranks, a worker slot each: {len(held)} trials, {counts}."
        " The timeline draws each trial on every worker it held.</p>",
        "<details><summary>Workers held per trial</summary>"
        '<table id="gangs"><tr><th>#</th><th>k</th><th>state</th><th>workers, rank order</th></tr>'
        f"{rows}</table></details>",
    ]


@contextlib.contextmanager
def written_if_stopped(study: Any, out: str | Path | None, ledger: Any = None) -> Iterator[None]:
    """A search that stops early (interrupted, or failed) writes its results so far to ``out``,
    if given; a failure to write them is logged, never raised over the reason it stopped."""
    try:
        yield
    except BaseException:
        if out is not None:
            try:
                write_results(study, out, ledger)
                logger.warning("stopped: the results so far are in %s", out)
            except Exception as error:
                logger.warning("could not write the results so far to %s: %s", out, error)
        raise


def finish(study: Any, out: str | Path | None, progress: bool, ledger: Any = None) -> None:
    """After a search: the results folder, if asked for, and the best trials and the hours'
    account (``hours: 0.42 core-h held, 81% finished, ...``) on the terminal."""
    if out is not None:
        write_results(study, out, ledger)
    if progress:
        print_best(study)
        split = ledger.account() if ledger is not None else None
        if split is not None and split.held > 0:
            from clusterkit.console import err
            from clusterkit.runners.hpo.account import line

            err().print(line(split), markup=False, highlight=False)
