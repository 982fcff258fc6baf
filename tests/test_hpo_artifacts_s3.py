"""Optuna's artifacts on S3 (issue #50): ``upload_artifact`` from a trial on a worker stores the
file through a ``Boto3ArtifactStore`` and links it to that trial in the driver's study.

The S3 API is moto's server on 127.0.0.1. botocore and moto need python-dateutil<3 and the
kubernetes package in the test venv needs >=3, so boto3 and moto live in a venv of their own,
``.tools/s3/venv`` (scripts/setup/45-s3.sh), with clusterkit, Optuna and the test venv's versions
of what a Dask worker shares with its scheduler. The scheduler runs in this process and the one
worker from that venv: the objective imports boto3 there (this process has no boto3), and the
bytes are read back from the S3 API through that venv's Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import optuna
import pytest

from clusterkit.runners import hpo

pytestmark = pytest.mark.local
optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker need not import tests/

ROOT = Path(__file__).resolve().parent.parent
S3_VENV = ROOT / ".tools" / "s3" / "venv"
BUCKET = "ck-artifacts"
AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def uploading_to_s3(trial: optuna.Trial) -> float:
    """Writes a note and uploads it to the bucket the worker's environment names (CK_TEST_S3:
    endpoint, bucket and a folder for the notes, as JSON)."""
    import os
    import sys

    import boto3
    from optuna.artifacts import Boto3ArtifactStore, upload_artifact

    where = json.loads(os.environ["CK_TEST_S3"])
    path = os.path.join(where["folder"], f"note-{trial.number}.txt")
    with open(path, "w") as handle:
        handle.write(f"trial {trial.number} on S3\n")
    # a session per trial: boto3.client's default session is not safe to make from two threads
    s3 = boto3.session.Session().client("s3", endpoint_url=where["endpoint"])
    store = Boto3ArtifactStore(where["bucket"], client=s3)
    upload_artifact(study_or_trial=trial, file_path=path, artifact_store=store)
    trial.set_user_attr("prefix", sys.prefix)
    return trial.suggest_float("x", 0.0, 1.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


@contextlib.contextmanager
def _started(command: list[str], env: dict[str, str], log: Path) -> Iterator[Any]:
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        _stop(process)


def _wait_answering(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # an S3 error document is an answer
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"moto_server did not answer at {url}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


def _s3_python(code: str, env: dict[str, str], *args: str) -> str:
    """``code`` run by the s3 venv's Python (boto3 is there), its standard output."""
    done = subprocess.run(
        [str(S3_VENV / "bin" / "python"), "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


MAKE_BUCKET = """
import sys, boto3
boto3.client("s3", endpoint_url=sys.argv[1]).create_bucket(Bucket=sys.argv[2])
"""

READ_BACK = """
import json, sys, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1])
read = {k: s3.get_object(Bucket=sys.argv[2], Key=k)["Body"].read().decode() for k in sys.argv[3:]}
print(json.dumps(read))
"""


def _same_releases_as_the_s3_venv() -> None:
    """The worker runs in the S3 venv, which 45-s3.sh builds with the project venv's Dask and
    Optuna: a driver with other releases (the compat tier's) cannot share pickles with it."""
    import dask

    ask = "import dask, optuna; print(dask.__version__, optuna.__version__)"
    there = subprocess.run(
        [str(S3_VENV / "bin" / "python"), "-c", ask], capture_output=True, text=True, check=True
    ).stdout.split()
    here = [dask.__version__, optuna.__version__]
    if there != here:
        pytest.skip(f"the S3 venv has dask/optuna {there}, this interpreter {here}")


def test_artifacts_uploaded_to_s3_on_a_worker_link_to_their_trial(tmp_path: Path) -> None:
    from distributed import Client, LocalCluster
    from optuna.artifacts import get_all_artifact_meta

    if not (S3_VENV / "bin" / "moto_server").exists():
        pytest.fail(f"{S3_VENV} has no moto_server: run scripts/setup/45-s3.sh")
    _same_releases_as_the_s3_venv()
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    (tmp_path / "notes").mkdir()
    env = {
        **os.environ,
        **AWS,
        "CK_TEST_S3": json.dumps(
            {"endpoint": endpoint, "bucket": BUCKET, "folder": str(tmp_path / "notes")}
        ),
    }
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage)
    with contextlib.ExitStack() as stack:
        moto_log = tmp_path / "moto.log"
        moto = stack.enter_context(
            _started(
                [str(S3_VENV / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                env,
                moto_log,
            )
        )
        _wait_answering(f"{endpoint}/moto-api/", moto, moto_log)
        _s3_python(MAKE_BUCKET, env, endpoint, BUCKET)

        cluster = stack.enter_context(
            LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None, protocol="tcp")
        )
        worker_log = tmp_path / "worker.log"
        command = [str(S3_VENV / "bin" / "dask"), "worker", cluster.scheduler_address]
        command += ["--nthreads", "2", "--no-dashboard", "--host", "127.0.0.1"]
        command += ["--local-directory", str(tmp_path / "worker")]
        worker = stack.enter_context(_started(command, env, worker_log))
        client = stack.enter_context(Client(cluster))
        try:
            client.wait_for_workers(1, timeout=90)
        except TimeoutError:
            pytest.fail(f"the s3 venv's worker did not join:\n{worker_log.read_text()[-4000:]}")
        hpo.run(
            uploading_to_s3, n_trials=6, client=client, study=study, progress=False, workdir=None
        )
        assert worker.poll() is None

        trials = study.get_trials()
        assert len(trials) == 6
        # each trial ran on the s3 venv's worker
        assert {Path(t.user_attrs["prefix"]).resolve() for t in trials} == {S3_VENV.resolve()}
        ids = {}
        for trial in trials:
            metas = get_all_artifact_meta(trial, storage=storage)
            assert [m.filename for m in metas] == [f"note-{trial.number}.txt"]
            ids[trial.number] = metas[0].artifact_id
        stored = json.loads(_s3_python(READ_BACK, env, endpoint, BUCKET, *sorted(ids.values())))
        assert {n: stored[key] for n, key in ids.items()} == {n: f"trial {n} on S3\n" for n in ids}
