"""A cluster's web pages answer their owner only (issue #51).

127.0.0.1 answers every user of the host. A second Unix user (`runuser`, as in the security
tests) asks every page of a default cluster's Dask HTTP servers (the scheduler's dashboard, its
info and JSON pages, ``/metrics``, the dashboard's websocket, each worker's ``/metrics``) and of
a study's dashboard, and must get 403 from each; the owner, with the secret the printed link
carries (as a bearer token, or the cookie the link sets), gets them. On `up`, an embedded
cluster, SSH (sshd on 127.0.0.1) and SLURM.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from clusterkit import api, state
from clusterkit.webauth import read_token
from tests import slurm as SL
from tests import sshd as S
from tests.test_faults import SECOND_USER, User, second_user  # noqa: F401 - fixture
from tests.test_slurm import empty_queue_after, profile_file  # noqa: F401 - fixture

#: Every kind of page: the dashboard, Dask's info and JSON pages, metrics, the route list.
ROUTES = [
    "/status",
    "/workers",
    "/info/main/workers.html",
    "/info/main/logs.html",
    "/json/identity.json",
    "/json/counts.json",
    "/metrics",
    "/sitemap.json",
    "/individual-plots.json",
]

#: The asker: GET each URL (no cookie, no secret), then open the status page's websocket by
#: hand; prints {url: status} as JSON.
ASK = textwrap.dedent("""
    import json, socket, sys, urllib.error, urllib.request
    from urllib.parse import urlsplit

    seen = {}
    for url in sys.argv[1:]:
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                seen[url] = answer.status
        except urllib.error.HTTPError as error:
            seen[url] = error.code
        except OSError as error:
            seen[url] = f"no connection: {error}"
    status = urlsplit(sys.argv[1])
    with socket.create_connection((status.hostname, status.port), timeout=10) as ws:
        ws.sendall(("GET /status/ws HTTP/1.1\\r\\nHost: x\\r\\nUpgrade: websocket\\r\\n"
                    "Connection: Upgrade\\r\\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\\r\\n"
                    "Sec-WebSocket-Version: 13\\r\\n\\r\\n").encode())
        line = ws.recv(200).split(b"\\r\\n")[0].decode()
    seen["websocket /status/ws"] = int(line.split()[1])
    print(json.dumps(seen))
""")


def _dask_pages(base: str, workers: list[str]) -> list[str]:
    return [f"{base}{route}" for route in ROUTES] + [f"{w}/metrics" for w in workers]


def _worker_pages(record: Any) -> list[str]:
    """Each worker's HTTP server, as the scheduler knows it (asked by the owner)."""
    from clusterkit.client import connect

    with connect(record, timeout=30) as client:
        workers = client.scheduler_info(n_workers=-1)["workers"].values()
    return [f"http://{w['host']}:{w['services']['dashboard']}" for w in workers]


def _owner_reads(url: str, token: str) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return bytes(answer.read())


def assert_only_the_owner_gets_in(record: Any, user: User) -> dict[str, Any]:
    """The second user is refused every page; the owner reads them with the secret."""
    token = read_token(record.security["web_token_file"])
    base = record.dashboard.rsplit("/", 1)[0]
    pages = _dask_pages(base, _worker_pages(record))
    asked = user.run("-c", ASK, *pages)
    assert asked.returncode == 0, asked.stderr[-3000:]
    seen = json.loads(asked.stdout)
    assert set(seen.values()) == {403}, seen
    metrics = _owner_reads(f"{base}/metrics", token).decode()
    assert "dask_scheduler_workers" in metrics
    assert _owner_reads(f"{base}/json/identity.json", token).startswith(b"{")
    for page in pages[-1:]:  # a worker's metrics
        assert b"dask_worker" in _owner_reads(page, token)
    return seen


@pytest.mark.local
def test_second_user_gets_no_page_of_a_cluster_from_up(
    second_user: User,  # noqa: F811 - fixture
) -> None:
    record = api.up("local", name="web-up")
    try:
        seen = assert_only_the_owner_gets_in(record, second_user)
    finally:
        api.down("web-up")
    print(f"asked by {SECOND_USER}: {seen}")


EMBEDDED = textwrap.dedent("""
    import json, sys
    from clusterkit import dashboard_link, get_client
    with get_client("local") as client:
        print(json.dumps({"link": dashboard_link(client)}), flush=True)
        sys.stdin.readline()
""")


@pytest.mark.local
def test_second_user_gets_no_page_of_an_embedded_cluster(
    second_user: User,  # noqa: F811 - fixture
) -> None:
    """The owner's `dashboard_link(client)` carries the secret; without it, nothing."""
    owner = subprocess.Popen(
        [sys.executable, "-c", EMBEDDED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        link = json.loads(owner.stdout.readline())["link"]
        bare, _, secret = link.partition("?token=")
        base = bare.rsplit("/", 1)[0]
        asked = second_user.run("-c", ASK, *_dask_pages(base, []))
        assert set(json.loads(asked.stdout).values()) == {403}, asked.stdout + asked.stderr
        assert b"dask_scheduler_workers" in _owner_reads(f"{base}/metrics", secret)
    finally:
        owner.communicate("\n", timeout=60)


@pytest.mark.local
def test_second_user_gets_no_page_of_a_study_dashboard(
    second_user: User,  # noqa: F811 - fixture
    tmp_path: Path,
) -> None:
    import optuna

    from clusterkit.runners.hpo.dashboard import serve

    storage = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    with serve(storage, "s") as view:
        base = f"http://127.0.0.1:{view.port}"
        asked = second_user.run("-c", ASK.split("status = urlsplit")[0] + "print(json.dumps(seen))",
                                *(f"{base}{p}" for p in ("/api/studies", "/dashboard", "/study/s")))
        assert set(json.loads(asked.stdout).values()) == {403}, asked.stdout + asked.stderr
        assert b'"study_name": "s"' in _owner_reads(f"{base}/api/studies", view.token)


@pytest.mark.slurm
def test_second_user_gets_no_page_of_a_slurm_cluster(
    slurm: SL.Slurm,
    second_user: User,  # noqa: F811 - fixture
    tmp_path: Path,
) -> None:
    record = api.up(profile_file(tmp_path, "web-slurm", scheduler={"dashboard": True}))
    try:
        assert_only_the_owner_gets_in(record, second_user)
    finally:
        api.down(record.name)


@pytest.mark.ssh
def test_second_user_gets_no_page_of_an_ssh_cluster(
    second_user: User,  # noqa: F811 - fixture
    tmp_path: Path,
) -> None:
    """Scheduler and worker started over SSH on 127.0.0.1; their gate reads the secret's copy
    uploaded beside the certificates."""
    reason = S.missing_reason()
    if reason:
        pytest.skip(reason)
    keys = S.Keys.generate(tmp_path / "keys")
    server = S.start_sshd(keys, "web")
    try:
        profile = tmp_path / "web-ssh.yaml"
        profile.write_text(
            yaml.safe_dump(
                {
                    "backend": "ssh",
                    "hosts": ["127.0.0.1"],
                    "port": server.port,
                    "user": "root",
                    "identity_files": [str(keys.client_key)],
                    "known_hosts": str(S.write_known_hosts(tmp_path / "known", keys, [server])),
                    "remote_python": sys.executable,
                    "start_timeout": 60,
                }
            )
        )
        record = api.up(profile)
        try:
            assert_only_the_owner_gets_in(record, second_user)
        finally:
            api.down(record.name)
        assert state.read_record(record.name) is None
    finally:
        server.stop()
