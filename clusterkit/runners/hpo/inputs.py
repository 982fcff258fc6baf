"""HPO inputs: objective files, storage specs, study names, and resuming an interrupted study."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from clusterkit.errors import BadInput

logger = logging.getLogger(__name__)

#: user_attrs keys the runner writes on each trial.
ATTR_WORKER = "ck_worker"
ATTR_TIME = "ck_time"  # [start, end] in seconds since the epoch, on the worker
ATTR_ATTEMPTS = "ck_attempts"
ATTR_ERROR = "ck_error"
ATTR_ORPHANED = "ck_orphaned"
ATTR_RETRY_OF = "ck_retry_of"
ATTR_GANG = "ck_gang"  # the workers a multi-rank trial held, in rank order


def load_objective(target: str) -> Callable[..., Any]:
    """``FILE.py:FUNC`` -> the function, pickled by value so workers need not see the file."""
    import cloudpickle

    path_text, sep, func_name = target.rpartition(":")
    if not sep or not path_text or not func_name:
        raise BadInput(f"objective {target!r} is not FILE.py:FUNC", hint="e.g. search.py:objective")
    path = Path(path_text)
    if not path.is_file():
        raise BadInput(f"objective file {path_text!r} does not exist")
    if not func_name.isidentifier():
        raise BadInput(f"{func_name!r} in {target!r} is not a Python function name")
    module_name = "clusterkit_objective_" + re.sub(r"\W", "_", path.resolve().stem)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise BadInput(f"objective file {path_text!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise BadInput(f"loading {path_text!r} failed: {type(error).__name__}: {error}") from error
    function = getattr(module, func_name, None)
    if not callable(function):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise BadInput(
            f"{path_text!r} has no function {func_name!r}",
            hint=f"it defines: {', '.join(names) or 'nothing callable'}",
        )
    cloudpickle.register_pickle_by_value(module)
    return function


def default_study_name(objective: Callable[..., Any]) -> str:
    """``<file stem>-<function name>``: the same for the CLI and the script that defines it."""
    code = getattr(objective, "__code__", None)
    stem = Path(code.co_filename).stem if code is not None else "study"
    name = getattr(objective, "__name__", type(objective).__name__)
    return re.sub(r"[^\w.-]", "_", f"{stem}-{name}")


def resolve_storage(spec: Any, study_name: str) -> Any:
    """A storage object from None (journal file ``./<study>.optuna.log``), a URL or a path.

    ``sqlite:///x.db``, ``postgresql://...`` and other SQLAlchemy URLs give an RDBStorage; a
    plain path gives a journal file. Anything else is a BadInput naming what is accepted.
    """
    import optuna
    from optuna.storages import BaseStorage

    if isinstance(spec, BaseStorage):
        return spec
    if spec is None:
        spec = f"{study_name}.optuna.log"
    text = str(spec)
    if "://" in text:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        try:
            url = make_url(text)
            url.get_dialect()
        except (ArgumentError, NoSuchModuleError, ValueError) as error:
            raise BadInput(
                f"storage {text!r} is not a usable database URL: {error}",
                hint="use sqlite:///FILE.db, postgresql://..., mysql://..., or a journal file path",
            ) from error
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            from clusterkit.runners.workdir import writes

            writes(url.database)  # as a journal: no part of a project it lies in
        try:
            return optuna.storages.RDBStorage(text)
        except Exception as error:
            raise BadInput(f"storage {text!r} cannot be opened: {error}") from error
    path = Path(text)
    if text.endswith((":", "/")) or path.is_dir() or not path.parent.is_dir():
        raise BadInput(
            f"storage {text!r} is neither a database URL nor a file in an existing directory",
            hint="use sqlite:///FILE.db, postgresql://..., or a journal file like study.optuna.log",
        )
    from clusterkit.runners.hpo.storage import open_journal
    from clusterkit.runners.workdir import writes

    writes(path)  # written all along the search: no part of a project it lies in
    return open_journal(str(path))


def counted(trial: Any) -> bool:
    """Whether a trial counts toward ``n_trials``: finished and not an orphan replaced later."""
    return trial.state.is_finished() and not trial.user_attrs.get(ATTR_ORPHANED)


def say_if_done(study: Any, done: int, n_trials: int) -> None:
    """A resumed study that already holds ``n_trials`` finished trials (``done``) runs none:
    say so."""
    if done >= n_trials:
        logger.warning(
            "study '%s' already holds %d finished trials, n_trials is %d: nothing to run "
            "(n_trials counts the study's trials; raise it to go on, or name another study)",
            study.study_name,
            done,
            n_trials,
        )


def storage_of(study: Any) -> Any:
    """The study's storage. Optuna has no public accessor, and the runner writes to trials it
    holds no ``Trial`` object for (records from workers, attempts, orphans), so this is the one
    place that reads the private attribute."""
    return study._storage


def recover_orphans(study: Any) -> list[int]:
    """Fail trials left RUNNING by a dead driver and enqueue their parameters again.

    Only one driver may run a study at a time: a RUNNING trial at start belongs to no one.
    Returns the numbers of the trials recovered.
    """
    from optuna.trial import TrialState

    storage = storage_of(study)
    recovered = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage.set_trial_user_attr(trial._trial_id, ATTR_ORPHANED, True)
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        study.enqueue_trial(
            trial.params,
            user_attrs={ATTR_RETRY_OF: trial.user_attrs.get(ATTR_RETRY_OF, trial.number)},
            skip_if_exists=False,
        )
        recovered.append(trial.number)
    if recovered:
        logger.info("recovered orphaned trials %s; their parameters are enqueued", recovered)
    return recovered


def check_counts(n_trials: int, max_retries: int, lookahead: int = 0, max_resumes: int = 0) -> None:
    if n_trials < 1:
        raise BadInput(f"n_trials must be at least 1, got {n_trials}")
    counts = (("max_retries", max_retries), ("lookahead", lookahead), ("max_resumes", max_resumes))
    for name, value in counts:
        if value < 0:
            raise BadInput(f"{name} must be 0 or more, got {value}")


def open_study(
    objective: Any,
    storage: Any,
    study_name: str | None,
    direction: str | None,
    sampler: Any,
    pruner: Any,
    directions: Sequence[str] | None = None,
) -> Any:
    """Create the study, or load it to resume when the storage holds one of that name: the
    one ``direction`` or the ``directions`` given (not both; neither: minimize, or as the
    study to resume has them) must be the resumed study's (BadInput otherwise)."""
    import optuna

    from clusterkit.runners.hpo.knobs import study_directions

    wanted = study_directions(direction, directions)
    name = study_name or default_study_name(objective)
    opened = resolve_storage(storage, name)
    if wanted is not None:
        check_study_directions(opened, name, wanted)
    return optuna.create_study(
        storage=opened,
        study_name=name,
        directions=wanted,  # type: ignore[arg-type]  # names, checked
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )


def check_study_directions(storage: Any, study_name: str, directions: Sequence[str]) -> None:
    """A study of that name that the storage holds already (one to resume) has ``directions``
    (BadInput otherwise: Optuna would resume it as it is, whatever was asked)."""
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:  # a new study
        return
    held = [d.name.lower() for d in storage.get_study_directions(study_id)]
    if held != list(directions):
        raise BadInput(
            f"study {study_name!r} exists with directions {' '.join(held)}, not "
            f"{' '.join(directions)} as given: a resumed study keeps its directions",
            hint="give its own, or name another study",
        )
