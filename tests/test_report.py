"""The HPO results folder: one offline report.html with every plot, PNGs, trials.csv."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from clusterkit.runners.hpo import report
from clusterkit.runners.hpo.inputs import ATTR_TIME, ATTR_WORKER

pytestmark = pytest.mark.unit
optuna.logging.set_verbosity(optuna.logging.WARNING)

#: In plotly.js's license header, once per inlined copy of the bundle.
BUNDLE_MARK = "plotly.js v"
PLOTS = ("optimization_history", "param_importances", "timeline")


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


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return report.write_results(small_study(), tmp_path_factory.mktemp("results") / "out")


def test_folder_holds_one_report_pngs_and_csv(folder: Path) -> None:
    files = {p.name for p in folder.iterdir()}
    assert files == {"trials.csv", "report.html", *(f"{name}.png" for name in PLOTS)}
    assert len((folder / "trials.csv").read_text().splitlines()) == 1 + 6


def test_report_inlines_plotly_js_once_and_shows_every_plot(folder: Path) -> None:
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert page.count(BUNDLE_MARK) == 1
    bundles = [s for s in re.findall(r"<script.*?</script>", page, re.S) if BUNDLE_MARK in s]
    assert len(bundles) == 1
    for name in PLOTS:
        assert f'id="{name}"' in page, name
        assert re.search(rf'Plotly\.newPlot\(\s*"{name}"', page), name  # and drawn into it
    for heading in report.HEADINGS.values():
        assert f"<h2>{heading}</h2>" in page
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
        report._pyplot().close(figure)


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
