"""Optuna's own storage test suite against the storage a trial sees inside a worker.

``optuna.testing.pytest_storages.StorageTestCase`` is what Optuna ships for third-party
storages. Here each of its cases runs inside a worker of a real cluster, as a task, on the
storage a trial gets there (``mirror.TrialView``), whose calls go to the driver's storage over
the cluster (:mod:`clusterkit.runners.hpo.remote`): in this test process, an Optuna
``InMemoryStorage`` answered as the search's driver answers, one per case. What a trial
serves from its worker's mirror (its own trial, the study's trials and attributes) is tested
with real searches, every built-in sampler and pruner (``test_hpo_optuna_parity.py``).
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import cloudpickle
import optuna
import pytest
from optuna.testing.pytest_storages import StorageTestCase

from clusterkit.runners.hpo import remote

pytestmark = [pytest.mark.local, pytest.mark.seam]  # seam: Optuna's own storage test suite
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _cases() -> list[Any]:
    """Every test of the suite, its parametrisations expanded, as pytest params."""
    cases = []
    for name in sorted(n for n in dir(StorageTestCase) if n.startswith("test_")):
        marks = getattr(getattr(StorageTestCase, name), "pytestmark", [])
        grids = []
        for mark in (m for m in marks if m.name == "parametrize"):
            names, values = mark.args[0], mark.args[1]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            rows = [v if len(names) > 1 else (v,) for v in values]
            grids.append([dict(zip(names, row, strict=True)) for row in rows])
        for i, combination in enumerate(itertools.product(*grids)):
            kwargs = {k: v for part in combination for k, v in part.items()}
            case_id = name if not grids else f"{name}[{i}]"
            cases.append(pytest.param(name, kwargs, id=case_id))
    return cases


class Driver:
    """The driver's side for one case: a storage answering the worker's calls on a topic."""

    def __init__(self, client: Any, storage: Any) -> None:
        self.client, self.storage = client, storage
        self.topic = f"storage-suite-{uuid.uuid4().hex[:8]}"
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.calls = 0
        client.subscribe_topic(self.topic, lambda event: self.inbox.put(event[1]))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (msg := self.inbox.get()) is not None:
            if msg.get("kind") != "call":
                continue
            self.calls += 1
            _, _, _, reply = remote.answer(self.storage, msg["request"])
            self.client.sync(self.client.scheduler.queue_put, name=msg["reply"], data=reply)

    def close(self) -> None:
        self.client.unsubscribe_topic(self.topic)
        self.inbox.put(None)
        self.thread.join(timeout=10)


def run_case(name: str, kwargs: dict[str, Any], topic: str) -> str:
    """In a worker: the suite's case ``name`` on the storage a trial gets there; the class of
    that storage (what the case ran against)."""
    from clusterkit.runners.hpo.mirror import TrialView
    from clusterkit.runners.hpo.worker import Channel

    channel = Channel(topic, 0, 1)
    storage = TrialView(None, None, None, None, channel.call)
    try:
        getattr(StorageTestCase(), name)(storage, **kwargs)
    finally:
        channel.close()
    return type(storage).__qualname__


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from tests.clusters import local_client

    with local_client(1) as connected:
        yield connected


@pytest.mark.parametrize(("name", "kwargs"), _cases())
def test_optunas_storage_suite_inside_a_worker(client: Any, name: str, kwargs: Any) -> None:
    driver = Driver(client, optuna.storages.InMemoryStorage())
    try:
        future = client.submit(run_case, name, kwargs, driver.topic, pure=False)
        assert future.result(timeout=120) == "TrialView"
    finally:
        driver.close()
    worker = next(iter(client.scheduler_info()["workers"]))
    assert future.key in client.who_has([future])  # it ran on the cluster's worker
    assert client.who_has([future])[future.key] == (worker,)
    assert driver.calls > 0, "the case made no call of the driver's storage"
