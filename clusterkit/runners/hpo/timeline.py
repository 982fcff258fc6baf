"""The timeline plot: each trial as a bar on the worker it ran on; the gaps are idle time.

Attempts lost with their worker (the account's, :mod:`.account`) are drawn too, as ``lost``;
:func:`hours_plotly` / :func:`hours_matplotlib` draw the account's split as one bar.

A gang trial (``ranks_per_trial``) is drawn on every worker its gang held, in one colour per trial
and labelled ``#7 (k=4)``, its state shown by hatching; a single-rank search colours by state.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, NamedTuple

from clusterkit.runners.hpo import inputs
from clusterkit.runners.hpo.inputs import ATTR_GANG

STATE_COLORS = {"COMPLETE": "#4c78a8", "PRUNED": "#f58518", "FAIL": "#e45756", "LOST": "#9d4edd"}
#: Hatching of a gang trial's bars by state (plotly's pattern shapes, matplotlib's hatches).
STATE_HATCHES = {"COMPLETE": "", "PRUNED": "/", "FAIL": "x", "LOST": "."}
#: The account's kinds (finished, pruned, failed, lost, idle) -> their colour.
KIND_COLORS = dict(
    zip(("finished", "pruned", "failed", "lost"), STATE_COLORS.values(), strict=True)
)
KIND_COLORS["idle"] = "#d9d9d9"
#: Gang trials' colours, by trial number: light (Set3, tan for its second yellow), for black labels.
TRIAL_COLORS = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
    "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#e5c494",
)  # fmt: skip
EDGE = "#444444"


class Bar(NamedTuple):
    """One trial on one worker: start and end in seconds since the epoch, and its gang's size."""

    worker: str
    start: float
    end: float
    number: int
    state: str
    size: int | None  # ranks of the trial's gang; None when it recorded no gang

    @property
    def label(self) -> str:
        return f"#{self.number}" if self.size is None else f"#{self.number} (k={self.size})"

    def color(self, gangs: bool) -> str:
        """One colour per trial in a gang search (its rows match), else one per state."""
        if gangs:
            return TRIAL_COLORS[self.number % len(TRIAL_COLORS)]
        return STATE_COLORS.get(self.state, "#999999")


def bars(study: Any, lost: Iterable[Any] = ()) -> list[Bar]:
    """A bar per trial and worker it held, for each trial that recorded where and when it ran;
    and one per ``lost`` attempt (the account's segments, :class:`.account.Segment`)."""
    found = [Bar(s.worker, s.start, s.end, s.trial, "LOST", None) for s in lost]
    for trial in study.get_trials(deepcopy=False):
        span = trial.user_attrs.get(inputs.ATTR_TIME)
        gang = trial.user_attrs.get(ATTR_GANG)
        single = trial.user_attrs.get(inputs.ATTR_WORKER)
        workers = list(dict.fromkeys(gang)) if gang else [single] if single else []
        size, state = (len(gang) if gang else None), trial.state.name
        if span:
            found += [Bar(w, span[0], span[1], trial.number, state, size) for w in workers]
    return found


def has_gangs(rows: list[Bar]) -> bool:
    return any(bar.size is not None for bar in rows)


def title(rows: list[Bar]) -> str:
    """The title, with the utilisation: busy time over (workers x wall time)."""
    workers = {bar.worker for bar in rows}
    busy = sum(bar.end - bar.start for bar in rows)
    span = max(max(bar.end for bar in rows) - min(bar.start for bar in rows), 1e-9)
    held = ", each on every worker its gang held" if has_gangs(rows) else ""
    return f"trials per worker{held}: utilisation {busy / (len(workers) * span):.0%}"


def timeline_plotly(study: Any, lost: Iterable[Any] = ()) -> Any:
    """The timeline as a plotly figure, one trace per state; None without rows."""
    import plotly.graph_objects as go

    rows = bars(study, lost)
    if not rows:
        return None
    gangs, origin = has_gangs(rows), min(bar.start for bar in rows)
    style = {"textposition": "inside", "insidetextanchor": "middle", "marker_line_color": EDGE}
    figure = go.Figure()
    for state, color in STATE_COLORS.items():
        mine = [bar for bar in rows if bar.state == state]
        if mine:
            figure.add_bar(
                y=[bar.worker for bar in mine],
                x=[bar.end - bar.start for bar in mine],
                base=[bar.start - origin for bar in mine],
                orientation="h",
                name=state.lower(),
                marker_color=[bar.color(gangs) for bar in mine] if gangs else color,
                text=[bar.label for bar in mine],
                hovertemplate="trial %{text}: %{base:.2f}s + %{x:.2f}s<extra></extra>",
                **({**style, "marker_pattern_shape": STATE_HATCHES[state]} if gangs else {}),
            )
    figure.update_layout(
        title=title(rows),
        xaxis_title="seconds",
        barmode="overlay",
        height=max(320, 160 + 40 * len({bar.worker for bar in rows})),
    )
    return figure


def timeline_matplotlib(study: Any, lost: Iterable[Any] = ()) -> Any:
    """The timeline as a matplotlib figure, its legend right of the axes; None without rows."""
    rows = bars(study, lost)
    if not rows:
        return None
    gangs, origin = has_gangs(rows), min(bar.start for bar in rows)
    workers = sorted({bar.worker for bar in rows})
    fig, axes = pyplot().subplots(figsize=(10, 1 + 0.5 * len(workers)))
    for bar in rows:
        axes.barh(
            workers.index(bar.worker),
            bar.end - bar.start,
            left=bar.start - origin,
            color=bar.color(gangs),
            **({"edgecolor": EDGE, "hatch": STATE_HATCHES[bar.state]} if gangs else {}),
        )
    if gangs:
        _label_bars(axes, rows, origin, [workers.index(bar.worker) for bar in rows])
    axes.legend(
        handles=_legend(gangs),
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
    axes.set_yticks(range(len(workers)), workers)
    axes.set_xlabel("seconds")
    axes.set_title(title(rows))
    return fig


def _label_bars(axes: Any, rows: list[Bar], origin: float, levels: list[int]) -> None:
    """Each gang bar's trial and size, on two lines, where the bar is wide enough to hold them."""
    inches = axes.get_window_extent().width / axes.figure.dpi
    low, high = axes.get_xlim()
    wide = 0.32 * (high - low) / inches  # "#12" / "k=4" at 7 points: about 0.3 inch
    for bar, level in zip(rows, levels, strict=True):
        if bar.end - bar.start >= wide:
            text = f"#{bar.number}\nk={bar.size}"
            middle = (bar.start + bar.end) / 2 - origin
            box = (
                {"facecolor": "white", "linewidth": 0, "pad": 1}
                if bar.state != "COMPLETE"
                else None
            )
            axes.text(
                middle, level, text, ha="center", va="center", fontsize=7, clip_on=True, bbox=box
            )


def _legend(gangs: bool) -> list[Any]:
    """State colours; in a gang search (colour = trial), state hatches."""
    from matplotlib.patches import Patch

    if not gangs:
        return [Patch(color=c, label=s.lower()) for s, c in STATE_COLORS.items()]
    return [
        Patch(facecolor="white", edgecolor=EDGE, hatch=h, label=s.lower())
        for s, h in STATE_HATCHES.items()
    ]


def hours_title(account: Any) -> str:
    from clusterkit.runners.hpo.account import hours

    return f"{account.unit}-hours held: {hours(account.held, account.unit)}, where they went"


def hours_plotly(account: Any) -> Any:
    """The account's split (:class:`.account.Account`) as one stacked bar, in hours."""
    import plotly.graph_objects as go

    figure = go.Figure()
    held = account.held or 1.0
    for kind, color in KIND_COLORS.items():
        seconds = account.total[kind]
        figure.add_bar(
            y=["held"],
            x=[seconds / 3600],
            orientation="h",
            name=f"{kind} {seconds / held:.0%}",
            marker_color=color,
            hovertemplate=f"{kind}: %{{x:.3g}} {account.unit}-h<extra></extra>",
        )
    figure.update_layout(
        title=hours_title(account),
        barmode="stack",
        xaxis_title=f"{account.unit}-hours",
        height=260,
    )
    return figure


def hours_matplotlib(account: Any) -> Any:
    """The account's split as one stacked bar, its legend right of the axes."""
    fig, axes = pyplot().subplots(figsize=(10, 1.8))
    left, held = 0.0, account.held or 1.0
    for kind, color in KIND_COLORS.items():
        width = account.total[kind] / 3600
        axes.barh(0, width, left=left, color=color, label=f"{kind} {width * 3600 / held:.0%}")
        left += width
    axes.set_yticks([0], ["held"])
    axes.set_xlabel(f"{account.unit}-hours")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    axes.set_title(hours_title(account))
    return fig


def pyplot() -> Any:
    """matplotlib.pyplot, on the Agg backend unless pyplot was imported before."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt
