"""A search spec, run: its inputs checked before anything starts (:func:`prepare`), the spec a
detached run records (:func:`detached`), and the search driven from this process with what
``clusterkit hpo`` shows (:func:`run`), in a terminal or a detached run's driver alike."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.client import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from clusterkit.runs.spec import HpoOptions, RunSpec


@dataclass
class Search:
    """What a search spec names, loaded: the objective, the opened storage, the study name,
    the project trials run in (None: the objective alone), the sampler and the pruner (None:
    Optuna's)."""

    objective: Any
    storage: Any
    study_name: str
    project: Any
    sampler: Any = None
    pruner: Any = None


def cluster_is_up(name: str) -> bool:
    """Whether ``name`` is a cluster from `up` (attached to by name: no profile needed)."""
    from clusterkit import state

    if name.endswith((".yaml", ".yml")) or "/" in name:
        return False
    record = state.read_record(name)
    return record is not None and state.is_live(record)


def check_profile(profile: str | None) -> None:
    """A profile that is no cluster from `up` must load (BadInput otherwise)."""
    if profile is not None and not cluster_is_up(profile):  # unknown: fails here
        from clusterkit.profiles import load_profile

        load_profile(profile)


def scan_project(file: str, workdir: str | None, max_size: str | None) -> Any:
    """The project of ``file`` (or ``workdir``), scanned now: too big or missing fails before
    anything starts."""
    from clusterkit.runners.workdir import parse_max_size, scan

    limit = parse_max_size("--workdir-max-size", max_size) if max_size else None
    if workdir is None:
        path = Path(file)
        if not path.is_file():
            return None  # load_objective names the missing file
        workdir = str(path.resolve().parent)
    return scan(workdir, max_size=limit)


@contextlib.contextmanager
def _on_path(directory: str | None) -> Iterator[None]:
    """The project first on ``sys.path`` while the objective loads (sibling imports work as
    under ``python FILE.py``)."""
    if directory is None:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        sys.path.remove(directory)


def prepare(spec: RunSpec) -> Search:
    """Load what the spec names, in the order a mistake is found: the sampler and pruner, the
    project, the objective, the profile, the storage, the directions of a study to resume
    (BadInput naming the first that is wrong)."""
    from clusterkit.runners.hpo import inputs as hpo_inputs
    from clusterkit.runners.hpo import knobs

    options: HpoOptions = spec.options  # type: ignore[assignment]
    sampler = knobs.make_sampler(options.sampler, options.sampler_kwargs)
    pruner = knobs.make_pruner(options.pruner, options.pruner_kwargs)
    project = None
    if not options.no_workdir:
        file = spec.target.rpartition(":")[0]
        project = scan_project(file, options.workdir, options.workdir_max_size)
    with _on_path(project.root if project is not None else None):
        objective = hpo_inputs.load_objective(spec.target)
    check_profile(spec.profile)
    name = options.study_name or hpo_inputs.default_study_name(objective)
    storage = hpo_inputs.resolve_storage(options.storage, name)
    hpo_inputs.check_study_directions(storage, name, options.directions)
    return Search(objective, storage, name, project, sampler, pruner)


def absolute(path: str, cwd: str) -> str:
    return str((Path(cwd) / Path(path).expanduser()).resolve())


def detached(spec: RunSpec, search: Search) -> RunSpec:
    """The spec a detached run records: every name filled in and every path absolute (the
    driver resolves nothing against a terminal's directory that may be gone); what only a
    terminal shows (``--json``, ``--dashboard``, ``--no-progress``) is left out."""
    options: HpoOptions = spec.options  # type: ignore[assignment]
    cwd, name = spec.cwd, search.study_name
    file, _, function = spec.target.rpartition(":")
    profile, storage = spec.profile, options.storage or f"{name}.optuna.log"
    if profile is not None and profile.endswith((".yaml", ".yml")):
        profile = absolute(profile, cwd)
    url, workdir = options.checkpoint_dir, options.workdir
    return spec.replaced(
        target=f"{absolute(file, cwd)}:{function}",
        profile=profile,
        study_name=name,
        out=absolute(options.out or f"{name}-results", cwd),
        storage=storage if "://" in storage else absolute(storage, cwd),
        checkpoint_dir=url if url is None or "://" in url else absolute(url, cwd),
        workdir=None if options.no_workdir or workdir is None else absolute(workdir, cwd),
        progress=True,
        dashboard=False,
        as_json=False,
    )


def run(spec: RunSpec, search: Search, attach_timeout: float = DEFAULT_TIMEOUT) -> int:
    """The search, driven from this process, then its result on stdout (``best:`` and
    ``results:`` lines, or ``--json``'s document); every record in the results folder's
    ``search.log``; SIGTERM stops it as Ctrl-C does. A search where no trial completed
    raises NoTrialCompleted (``--json``: its document on stdout first). ``attach_timeout``:
    seconds to wait for the cluster's scheduler."""
    from clusterkit.runners.hpo.records import NoTrialCompleted
    from clusterkit.runs.search_output import search_log, show_result, sigterm_stops

    options: HpoOptions = spec.options  # type: ignore[assignment]
    folder = options.out or f"{search.study_name}-results"
    with search_log(folder) as log, sigterm_stops():
        try:
            study = _search(spec, search, folder, attach_timeout)
        except NoTrialCompleted as error:
            error.hint = f"every traceback: {log}"
            if options.as_json:
                show_result(error.study, folder, log, as_json=True)
            raise
    show_result(study, folder, log, options.as_json)
    return 0


def _search(spec: RunSpec, search: Search, folder: str, attach_timeout: float) -> Any:
    """The search's study, searched from this process on the spec's profile."""
    from clusterkit.client import get_client
    from clusterkit.runners.hpo import run as run_search
    from clusterkit.runners.hpo.callbacks import mlflow_callback
    from clusterkit.runs.dashboard import search_dashboard

    options: HpoOptions = spec.options  # type: ignore[assignment]
    callbacks = [mlflow_callback(options.mlflow)] if options.mlflow else []
    gpus = options.gpus_per_trial
    client = get_client(spec.profile, timeout=attach_timeout)
    name, storage = search.study_name, search.storage
    view = search_dashboard(options.dashboard, storage, name, client, spec.profile)
    try:
        study = run_search(
            search.objective,
            n_trials=options.trials or 0,  # the spec requires it for FILE.py:FUNC
            client=client,
            storage=search.storage,
            study_name=search.study_name,
            directions=options.directions,
            sampler=search.sampler,
            pruner=search.pruner,
            resources={"GPU": gpus} if gpus else None,
            timeout=options.timeout,
            trial_walltime=options.trial_walltime,
            progress=options.progress,
            out=folder,
            workdir=search.project,
            ranks_per_trial=options.ranks_per_trial,
            checkpoint_dir=options.checkpoint_dir,
            max_retries=options.max_retries,
            max_resumes=options.max_resumes,
            lookahead=options.lookahead,
            callbacks=callbacks,
        )
    finally:
        view.close()
        client.close()
    return study
