"""Optuna's own storage test suite against every study storage clusterkit creates.

``optuna.testing.pytest_storages.StorageTestCase`` is what Optuna ships for third-party
storages: each storage :func:`clusterkit.runners.hpo.inputs.resolve_storage` makes (the
default batched journal file, the same named explicitly, an SQLite URL) must pass it whole,
pickling included. The workers' one-trial view (``mirror.TrialView``) is no study storage:
it refuses study creation by design and is tested with the search itself.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from optuna.study import StudyDirection
from optuna.testing.pytest_storages import StorageTestCase

from clusterkit.runners.hpo.inputs import resolve_storage
from clusterkit.runners.hpo.storage import BatchedJournalBackend, flush, open_journal

pytestmark = pytest.mark.unit

#: How clusterkit is told where a study lives: nothing (the default journal file in the
#: working directory), a journal file path, an SQLite URL.
SPECS = ("default", "journal", "sqlite")


def _storage_from(spec: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    if spec == "default":
        monkeypatch.chdir(folder)
        return resolve_storage(None, "suite")
    if spec == "journal":
        return resolve_storage(str(folder / "suite.optuna.log"), "suite")
    return resolve_storage(f"sqlite:///{folder / 'suite.db'}", "suite")


@pytest.fixture(params=SPECS)
def storage(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    made = _storage_from(request.param, tmp_path, monkeypatch)
    yield made
    engine = getattr(made, "engine", None)
    if engine is not None:
        engine.dispose()


class TestClusterkitStorages(StorageTestCase):
    """Every case of Optuna's suite, on every storage above."""


def test_the_default_storage_is_the_batched_journal(tmp_path: Path) -> None:
    made = resolve_storage(str(tmp_path / "s.optuna.log"), "s")
    assert isinstance(made._backend, BatchedJournalBackend)


def test_a_pickled_journal_holds_every_write_made_before_it(tmp_path: Path) -> None:
    """The copy reads the file: what the original still held in memory is on disk first, each
    log once, and the original goes on batching (and flushing) after it."""
    path = tmp_path / "s.optuna.log"
    original = open_journal(str(path))
    study_id = original.create_new_study([StudyDirection.MINIMIZE], "s")
    original.set_study_user_attr(study_id, "before", 1)
    copy = pickle.loads(pickle.dumps(original))
    assert copy.get_study_user_attrs(study_id) == {"before": 1}
    assert len(path.read_text().splitlines()) == 2
    original.set_study_user_attr(study_id, "after", 2)
    assert len(path.read_text().splitlines()) == 2
    flush(original)
    assert open_journal(str(path)).get_study_user_attrs(study_id) == {"before": 1, "after": 2}
    assert len(path.read_text().splitlines()) == 3
