"""The HPO results folder: one offline report.html with every plot, PNGs, trials.csv."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from clusterkit.runners.hpo import report, timeline
from clusterkit.runners.hpo.account import Ledger, Segment
from clusterkit.runners.hpo.inputs import ATTR_GANG, ATTR_TIME, ATTR_WORKER

pytestmark = pytest.mark.unit
optuna.logging.set_verbosity(optuna.logging.WARNING)

#: In plotly.js's license header, once per inlined copy of the bundle.
BUNDLE_MARK = "plotly.js v"
PLOTS = ("optimization_history", "param_importances", "timeline", "hours")


def small_study(with_workers: bool = True) -> Any:
    """Four complete, one pruned and one failed trial on two workers, as the runner records them."""
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), study_name="tiny")
    distributions = {"x": FloatDistribution(-1.0, 1.0), "n": IntDistribution(1, 5)}
    states = [TrialState.COMPLETE] * 4 + [TrialState.PRUNED, TrialState.FAIL]
    for i, state in enumerate(states):
        x = -1.0 + 0.3 * i
        attrs = {
            ATTR_WORKER: f"tcp://127.0.0.1:{4000 + i % 2}",
            ATTR_TIME: [1e9 + i, 1e9 + i + 1.5],
        }
        study.add_trial(
            create_trial(
                state=state,
                value=x * x + i if state == TrialState.COMPLETE else None,
                params={"x": x, "n": 1 + i % 5},
                distributions=distributions,
                user_attrs=attrs if with_workers else {},
                intermediate_values={0: x} if state == TrialState.PRUNED else None,
            )
        )
    return study


def small_ledger() -> Ledger:
    """The small study's two one-core workers held for 10 s, and one lost attempt."""
    ledger = Ledger(None, since=1e9)
    ledger.seen({f"tcp://127.0.0.1:{4000 + i}": {"nthreads": 1} for i in range(2)}, now=1e9)
    ledger.segments.append(Segment("tcp://127.0.0.1:4000", 6, 1e9 + 7, 1e9 + 9, 1, "lost"))
    ledger.until = 1e9 + 10
    return ledger


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("results") / "out"
    return report.write_results(small_study(), out, small_ledger())


def test_folder_holds_one_report_pngs_and_csv(folder: Path) -> None:
    files = {p.name for p in folder.iterdir()}
    assert files == {
        "trials.csv",
        "report.html",
        "account.json",
        *(f"{name}.png" for name in PLOTS),
    }
    assert len((folder / "trials.csv").read_text().splitlines()) == 1 + 6


def test_report_inlines_plotly_js_once_and_shows_every_plot(folder: Path) -> None:
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert page.count(BUNDLE_MARK) == 1
    bundles = [s for s in re.findall(r"<script.*?</script>", page, re.S) if BUNDLE_MARK in s]
    assert len(bundles) == 1
    for name in PLOTS:
        assert f'id="{name}"' in page, name
        assert re.search(rf'Plotly\.newPlot\(\s*"{name}"', page), name  # and drawn into it
    for name in PLOTS:  # a single objective's: no Pareto front
        assert f"<h2>{report.HEADINGS[name]}</h2>" in page
    assert "<title>tiny: HPO results</title>" in page
    # Nothing is fetched: no script from elsewhere, and no CDN outside the bundle's own text
    # (plotly.js mentions CDNs for map tiles and icons, which these plots do not use).
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert "https://cdn" not in page.replace(bundles[0], "")
    assert (folder / "report.html").stat().st_size < 5 * 1024 * 1024  # was ~4.8 MB per plot


def test_plot_divs_come_in_report_order(folder: Path) -> None:
    page = (folder / "report.html").read_text(encoding="utf-8")
    where = [page.index(f'id="{name}"') for name in PLOTS]
    assert where == sorted(where)
    assert page.index(BUNDLE_MARK) < where[0]  # plotly.js is defined before the first plot


def test_timeline_png_legend_is_outside_the_axes(folder: Path) -> None:
    assert (folder / "timeline.png").read_bytes().startswith(b"\x89PNG")
    figure = report.timeline_matplotlib(small_study())
    try:
        figure.canvas.draw()
        (axes,) = figure.axes
        renderer = figure.canvas.get_renderer()
        legend = axes.get_legend().get_window_extent(renderer)
        frame = axes.get_window_extent(renderer)
        assert legend.x0 > frame.x1, (legend, frame)
    finally:
        timeline.pyplot().close(figure)


def test_timeline_lists_every_worker_and_state() -> None:
    figure = report.timeline_plotly(small_study())
    assert {bar.name for bar in figure.data} == {"complete", "pruned", "fail"}
    workers = {w for bar in figure.data for w in bar.y}
    assert workers == {"tcp://127.0.0.1:4000", "tcp://127.0.0.1:4001"}
    assert "utilisation" in figure.layout.title.text


def test_study_without_worker_records_has_no_timeline(tmp_path: Path) -> None:
    study = small_study(with_workers=False)
    assert report.timeline_plotly(study) is None and report.timeline_matplotlib(study) is None
    folder = report.write_results(study, tmp_path / "out")
    files = {p.name for p in folder.iterdir()}
    assert "timeline.png" not in files and "report.html" in files
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert page.count(BUNDLE_MARK) == 1 and 'id="optimization_history"' in page


def test_report_without_plots_still_opens(tmp_path: Path) -> None:
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), study_name="<empty>")
    folder = report.write_results(study, tmp_path / "out")
    assert {p.name for p in folder.iterdir()} == {"trials.csv", "report.html"}
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert "No plot" in page and BUNDLE_MARK not in page and "&lt;empty&gt;" in page


# ---------------------------------------------------------------------- gang searches


def gang_study() -> Any:
    """Gang trials of 4, 2 and 1 ranks on four workers, the 2-rank one failed, the last one
    never started (no worker, no time); workers held in rank order, as the gang loop records."""
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), study_name="gangs")
    workers = [f"tcp://127.0.0.1:{5000 + i}" for i in range(4)]
    held = [workers, workers[2:], workers[1:2], None]
    spans = [[0.0, 2.0], [2.0, 4.0], [2.0, 3.0], None]  # seconds after 1e9: never sharing a slot
    states = [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE, TrialState.FAIL]
    for i, (gang, span, state) in enumerate(zip(held, spans, states, strict=True)):
        attrs: dict[str, Any] = {}
        if gang and span:
            attrs = {ATTR_WORKER: gang[0], ATTR_TIME: [1e9 + t for t in span], ATTR_GANG: gang}
        study.add_trial(
            create_trial(
                state=state,
                value=float(i) if state == TrialState.COMPLETE else None,
                params={"k": len(gang or [])},
                distributions={"k": IntDistribution(0, 4)},
                user_attrs=attrs,
            )
        )
    return study


def _bars_by_trial(figure: Any) -> dict[str, list[str]]:
    """The plotly timeline's rows per bar label, and each label's one colour."""
    rows: dict[str, list[str]] = {}
    colors: dict[str, set[str]] = {}
    for trace in figure.data:
        for label, worker, color in zip(trace.text, trace.y, trace.marker.color, strict=True):
            rows.setdefault(label, []).append(worker)
            colors.setdefault(label, set()).add(color)
    assert all(len(c) == 1 for c in colors.values()), colors  # one colour per trial
    assert len({c.pop() for c in colors.values()}) == len(colors)  # told apart by colour
    return rows


def test_gang_timeline_draws_each_trial_on_every_worker_it_held() -> None:
    study = gang_study()
    workers = study.trials[0].user_attrs[ATTR_GANG]
    rows = _bars_by_trial(timeline.timeline_plotly(study))
    assert rows == {"#0 (k=4)": workers, "#1 (k=2)": workers[2:], "#2 (k=1)": workers[1:2]}
    # utilisation counts each slot held: 4 x 2 s + 2 x 2 s + 1 s on 4 workers over 4 s
    assert timeline.title(timeline.bars(study)).endswith("utilisation 81%")
    figure = timeline.timeline_matplotlib(study)
    try:
        (axes,) = figure.axes
        assert len(axes.patches) == 7
        labels = sorted(t.get_text() for t in axes.texts)
        assert labels == ["#0\nk=4"] * 4 + ["#1\nk=2"] * 2 + ["#2\nk=1"]
        assert [t.get_text() for t in axes.get_legend().get_texts()] == list(
            map(str.lower, timeline.STATE_HATCHES)
        )
    finally:
        timeline.pyplot().close(figure)


def test_single_rank_timeline_keeps_one_colour_per_state() -> None:
    figure = timeline.timeline_plotly(small_study())
    for bar in figure.data:
        assert bar.marker.color == timeline.STATE_COLORS[bar.name.upper()]
        assert all(re.fullmatch(r"#\d+", label) for label in bar.text)
    assert "gang" not in figure.layout.title.text
    assert "Gangs" not in report.report_html(small_study(), {})


def test_report_lists_gang_sizes_and_workers(tmp_path: Path) -> None:
    folder = report.write_results(gang_study(), tmp_path / "out")
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert "Gangs of k ranks, a worker slot each: 3 trials, 1 of k=1, 1 of k=2, 1 of k=4." in page
    table = page[page.index('<table id="gangs">') : page.index("</table>")]
    assert "<tr><td>#1</td><td>2</td><td>fail</td>" in table
    assert "tcp://127.0.0.1:5002, tcp://127.0.0.1:5003</td>" in table
    assert table.count("<tr>") == 1 + 3 and "#3" not in table  # #3 never ran
    assert (folder / "timeline.png").is_file()


def test_gang_progress_says_how_gangs_hold_the_slots() -> None:
    running, load = report.gang_occupancy([2, 1, 4, 1], 8, 4)
    assert (running, load) == (
        "gangs 4 running (4+2+2x1 ranks)",
        "slots 8/8 busy | next in line: k=4",
    )
    assert report.gang_occupancy([], 8, None) == ("gangs 0 running", "slots 0/8 busy")


def test_progress_counts_trials_queued_ahead_apart_from_running_ones() -> None:
    display = report.ProgressDisplay(8)
    try:
        display.update(optuna.create_study(), running=2, busy=2, total=8, queued=2)
        detail = display.progress.tasks[0].fields["detail"]
    finally:
        display.close()
    assert detail.startswith("running 2 (+2 queued) |") and detail.endswith("workers busy 2")
