"""The study dashboard: optuna-dashboard of a live search in headless Chromium, read-only.

`clusterkit hpo --dashboard` runs a real search on a local cluster while Selenium drives
Debian's ``chromium`` through ``chromium-driver`` (scripts/setup/30-browser.sh) on the page it
printed; `clusterkit runs dashboard ID` serves a run's study and refuses every write.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from clusterkit import state
from clusterkit.runners.hpo.storage import flush, open_journal
from clusterkit.runs.records import RunRecord

pytestmark = [pytest.mark.local, pytest.mark.seam]  # seam: optuna-dashboard and bokeh in a browser

OBJECTIVE = """
import time

def objective(trial):
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.2)
    return x * x
"""
TRIALS_SHOWN = re.compile(r"(\d+) Trials")


def _browser() -> Any:
    """Headless Chromium under Selenium, offline: Debian's binary and its driver."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("chromium and chromium-driver are missing (scripts/setup/30-browser.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1300,1000")
    return webdriver.Chrome(service=Service(driver), options=options)


def _lines_until(process: subprocess.Popen[str], pattern: str, timeout: float) -> list[str]:
    """The process's output lines up to the first one matching ``pattern`` (read by a thread:
    a line can wait in the pipe's buffer where no selector sees it)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or ()]).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not (seen and re.search(pattern, seen[-1])):
        try:
            seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())).rstrip("\n"))
        except queue.Empty:
            pytest.fail(f"no line matching {pattern!r} in {timeout:g}s; the output: {seen}")
    return seen


def _url_in(lines: list[str], label: str) -> str:
    for line in lines:
        if line.startswith(f"{label}: "):
            return line.split()[2]
    raise AssertionError(f"no {label} line in {lines}")


def _status(
    url: str, method: str = "GET", body: bytes | None = None, token: str | None = None
) -> int:
    """The status of ``url`` as a browser gets it: redirects followed, cookies kept (the
    printed link carries the secret once; the page keeps it in a cookie); ``token``: sent as
    a bearer token, as Prometheus and curl do."""
    import http.cookiejar

    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with opener.open(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _secret(link: str) -> str:
    """The secret a printed link carries."""
    from urllib.parse import parse_qs, urlsplit

    return parse_qs(urlsplit(link).query)["token"][0]


def _read(url: str, token: str) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return bytes(answer.read())


def _port_closed(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def _cli(args: list[str], cwd: Path, **env: str) -> Iterator[subprocess.Popen[str]]:
    """``clusterkit ARGS`` in its own process group (stdout and stderr together), ended with
    Ctrl-C's signal if it is still running, then killed if it will not go."""
    process = subprocess.Popen(
        [sys.executable, "-m", "clusterkit", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200", **env},
        start_new_session=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _trials_shown(browser: Any) -> int | None:
    from selenium.common.exceptions import WebDriverException

    try:
        found = TRIALS_SHOWN.search(browser.find_element("tag name", "body").text)
    except WebDriverException:  # the page is being redrawn
        return None
    return int(found.group(1)) if found else None


def test_the_trial_count_rises_in_chromium_while_the_search_runs(tmp_path: Path) -> None:
    (tmp_path / "search.py").write_text(textwrap.dedent(OBJECTIVE))
    (tmp_path / "two.yaml").write_text("backend: local\nworkers: 2\nworker:\n  threads: 1\n")
    browser = _browser()
    args = ["hpo", "search.py:objective", "-n", "2000", "-p", "two.yaml", "--dashboard"]
    try:
        with _cli([*args, "--study-name", "live", "--no-progress"], tmp_path) as search:
            lines = _lines_until(search, r"^dask dashboard: ", timeout=120)
            page, dask = _url_in(lines, "study dashboard"), _url_in(lines, "dask dashboard")
            assert page.startswith("http://127.0.0.1:") and "(read-only)" in "\n".join(lines)
            assert _status(dask) == 200  # the cluster's Dask dashboard, linked beside it
            assert _status(dask.split("?")[0]) == 403  # and nothing without its secret
            _draws_its_plots(browser, dask)
            browser.get(page)  # redirects to the study's page once the study exists
            _until(lambda: "/dashboard/studies/" in browser.current_url, browser, page)
            browser.get(browser.current_url.rstrip("/") + "/trials")
            assert browser.title == "Optuna Dashboard"
            counts = _watch_count_rise(browser, search)
            browser.save_screenshot(str(tmp_path / "dashboard.png"))
            assert search.poll() is None, "the search ended before the count was seen rising"
            port = int(page.split(":")[2].split("/")[0])
            study_id = browser.current_url.split("/studies/")[1].split("/")[0]
            api = f"http://127.0.0.1:{port}/api/studies/{study_id}"
            secret = _secret(page)
            assert _status(api, "DELETE", token=secret) == 403  # read-only, even to its owner
            assert _status(api, token=secret) == 200 and _status(api) == 403  # still there
            os.killpg(search.pid, signal.SIGINT)  # Ctrl-C: the search and its dashboard end
            search.wait(120)
            assert _port_closed(port)
    finally:
        browser.quit()
    print(f"trial counts the page showed while the search ran: {counts}")
    assert counts[0] < counts[-1], counts
    assert (tmp_path / "dashboard.png").read_bytes().startswith(b"\x89PNG")


#: Canvases on the page, bokeh's included: it draws inside shadow roots, which selectors miss.
CANVASES = """
function count(node) {
  let found = node.tagName === "CANVAS" ? 1 : 0;
  if (node.shadowRoot) found += count(node.shadowRoot);
  for (const child of node.children || []) found += count(child);
  return found;
}
return count(document.documentElement);
"""


def _draws_its_plots(browser: Any, link: str) -> None:
    """The owner's link opens Dask's status page in Chromium, which draws its plots (bokeh's
    canvases), not the page that says bokeh is missing."""
    browser.get(link)
    _until(lambda: browser.execute_script(CANVASES) >= 4, browser, f"plots at {link}")
    assert "needs bokeh" not in browser.find_element("tag name", "body").text
    assert "token=" not in browser.current_url  # the secret left the address bar for a cookie


def _until(check: Any, browser: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out on {what}: at {browser.current_url}")
        time.sleep(0.2)


def _watch_count_rise(browser: Any, search: subprocess.Popen[str]) -> list[int]:
    """The trial counts the page showed, polled in its DOM until one rose over the first (the
    page re-polls the server on its own; nothing here reloads it)."""
    counts: list[int] = []
    deadline = time.monotonic() + 180
    while not (counts and counts[-1] > counts[0]):
        if time.monotonic() > deadline or search.poll() is not None:
            pytest.fail(f"the trial count shown did not rise while the search ran: {counts}")
        shown = _trials_shown(browser)
        if shown is not None and (not counts or shown != counts[-1]):
            counts.append(shown)
        time.sleep(0.2)
    return counts


def _finished_study(folder: Path) -> tuple[str, optuna.Study]:
    """A study of three trials in a batched journal, as a search leaves it."""
    path = folder / "done.optuna.log"
    storage = open_journal(str(path))
    study = optuna.create_study(study_name="done", storage=storage)
    study.optimize(lambda trial: trial.suggest_float("x", -1.0, 1.0) ** 2, n_trials=3)
    study.set_user_attr("kept", True)
    flush(storage)
    return str(path), study


def _snapshot(path: str) -> tuple[Any, ...]:
    """Everything a reader of the journal sees: the studies, their attributes, every trial."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(path))
    studies = [(s.study_name, s.user_attrs, s.system_attrs) for s in storage.get_all_studies()]
    trials = optuna.load_study(study_name="done", storage=storage).trials
    return studies, [repr(trial) for trial in trials]


WRITES = [
    ("POST", "/api/studies", {"study_name": "new", "directions": ["minimize"]}),
    ("POST", "/api/studies/0/rename", {"study_name": "renamed"}),
    ("DELETE", "/api/studies/0", None),
    ("PUT", "/api/studies/0/note", {"version": 0, "body": "hello"}),
    ("POST", "/api/trials/0/tell", {"state": "Fail"}),
    ("POST", "/api/trials/0/user-attrs", {"user_attrs": {"a": 1}}),
    ("PUT", "/api/studies/0/0/note", {"version": 0, "body": "hello"}),
    ("POST", "/api/studies/0/0/skip", None),
]


def test_runs_dashboard_serves_a_run_s_study_and_refuses_every_write(tmp_path: Path) -> None:
    path, _ = _finished_study(tmp_path)
    argv = ["search.py:objective", "--trials", "3", "--study-name", "done", "--storage", path]
    RunRecord("hpo-1126-d45b0a", "hpo", argv, str(tmp_path), "local", None, None).save()
    before = _snapshot(path)
    with _cli(["runs", "dashboard", "hpo-1126-d45b0a"], tmp_path, SSH_CONNECTION="1 2 3 4") as view:
        lines = _lines_until(view, r"^dask dashboard: ", timeout=60)
        page = _url_in(lines, "study dashboard")
        port = int(page.split(":")[2].split("/")[0])
        base = f"http://127.0.0.1:{port}"
        assert f"ssh -N -L {port}:127.0.0.1:{port} {state.HOST}" in "\n".join(lines)
        secret = _secret(page)
        assert _status(page) == 200 and _status(f"{base}/api/studies/0", token=secret) == 200
        assert _status(f"{base}/api/studies/0") == 403  # nothing without the secret
        refused = {
            (method, route): _status(
                f"{base}{route}", method, json.dumps(body or {}).encode(), token=secret
            )
            for method, route, body in WRITES
        }
        assert set(refused.values()) == {403}, refused
        os.killpg(view.pid, signal.SIGINT)
        assert view.wait(30) == 0
    assert _port_closed(port)
    assert _snapshot(path) == before


def test_runs_dashboard_serves_the_artifacts_trials_uploaded(tmp_path: Path) -> None:
    """``--artifacts DIR``: each trial's page lists what it uploaded, and the file comes back."""
    from optuna.artifacts import FileSystemArtifactStore, upload_artifact

    store_dir = tmp_path / "artifacts"
    store_dir.mkdir()
    store = FileSystemArtifactStore(str(store_dir))
    ids = {}

    def uploading(trial: optuna.Trial) -> float:
        note = tmp_path / f"note-{trial.number}.txt"
        note.write_text(f"trial {trial.number}")
        ids[trial._trial_id] = upload_artifact(
            study_or_trial=trial, file_path=str(note), artifact_store=store
        )
        return trial.suggest_float("x", -1.0, 1.0) ** 2

    path = str(tmp_path / "done.optuna.log")
    storage = open_journal(path)
    study = optuna.create_study(study_name="done", storage=storage)
    study.optimize(uploading, n_trials=3)
    flush(storage)
    argv = ["search.py:objective", "--trials", "3", "--study-name", "done", "--storage", path]
    RunRecord("hpo-1126-a27f0c", "hpo", argv, str(tmp_path), "local", None, None).save()
    command = ["runs", "dashboard", "hpo-1126-a27f0c", "--artifacts", str(store_dir)]
    with _cli(command, tmp_path) as view:
        lines = _lines_until(view, r"^dask dashboard: ", timeout=60)
        page = _url_in(lines, "study dashboard")
        base = "http://127.0.0.1:" + page.split(":")[2].split("/")[0]
        detail = json.loads(_read(f"{base}/api/studies/0", _secret(page)))
        listed = {
            t["trial_id"]: [a["artifact_id"] for a in t["artifacts"]] for t in detail["trials"]
        }
        assert listed == {trial_id: [artifact] for trial_id, artifact in ids.items()}
        for trial in study.trials:
            url = f"{base}/artifacts/0/{trial._trial_id}/{ids[trial._trial_id]}"
            assert _read(url, _secret(page)).decode() == f"trial {trial.number}"


def test_runs_dashboard_of_a_training_is_one_line_exit_2(tmp_path: Path) -> None:
    RunRecord("train-1126-aaaaaa", "train", ["t.py"], str(tmp_path), "local", None, None).save()
    done = subprocess.run(
        [sys.executable, "-m", "clusterkit", "runs", "dashboard", "train-1126-aaaaaa"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and "only searches have a study" in done.stderr


def test_the_dask_dashboard_of_a_cluster_on_another_host_comes_with_its_tunnel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSH_CONNECTION", raising=False)  # (a session over ssh adds a line)
    from clusterkit.runners.hpo.dashboard import links, serve
    from clusterkit.state import ClusterRecord

    far = ClusterRecord(
        name="c",
        backend="slurm",
        profile="p",
        profile_source=None,
        digest="",
        address="",
        dashboard="http://127.0.0.1:8790/status",
        pid=1,
        security={},
        min_workers=0,
        host="login7",
    )
    path, _ = _finished_study(tmp_path)
    with serve(path, "done") as view:
        shown = links(view, cluster=far)
    assert shown == [
        f"study dashboard: http://127.0.0.1:{view.port}/study/done?token={view.token} (read-only)",
        "dask dashboard: http://localhost:8790/status "
        "(first run: ssh -N -L 8790:127.0.0.1:8790 login7)",
    ]
    assert _port_closed(view.port)
