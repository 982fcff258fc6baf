"""Asynchronous, fault-tolerant Optuna search over any Dask client: :func:`run`.

Each trial is asked on the driver (``study.ask()``: RUNNING in storage at once) and shipped to a
worker with the changes to the study since the worker's mirror last caught up (:mod:`.mirror`,
:mod:`.changelog`): ``suggest_*`` samples on the worker with no round trip, and every write to
the trial goes back as a fire-and-forget ``log_event`` on the worker's scheduler connection
(secured by the profile, unlike a storage proxy's new plain TCP connection). ``should_prune`` is
the one synchronous call: the driver prunes on the study's current values and answers through
a scheduler Queue. The default storage batches writes between fsyncs (:mod:`.storage`); the
loop itself is :mod:`.loop`.

Fault tolerance: the sampler ships with its random state fixed, so when Dask re-runs a task
whose worker died the trial gets the same parameters; the driver counts attempts from the
workers' start messages and fails the trial past ``max_retries`` attempts lost with nothing
saved, or ``max_resumes`` from a checkpoint (:class:`~.dispatch.Retries`). Trials left RUNNING by a
killed driver are failed, marked ``ck_orphaned`` (not counted) and their parameters enqueued.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clusterkit.runners.hpo import gangs, inputs, preemption, records, report
from clusterkit.runners.hpo.callbacks import Callback, InOrder
from clusterkit.runners.hpo.dispatch import Retries, check_resources, slots
from clusterkit.runners.hpo.gangs import GangOptions, RanksPerTrial
from clusterkit.runners.hpo.loop import SearchLoop
from clusterkit.runners.hpo.records import best_summary as best_summary

if TYPE_CHECKING:
    import optuna
    from distributed import Client

    from clusterkit.runners.hpo.warmup import Warmup

#: What the loop is given, in :func:`drive`'s order: n_trials, resources, retries, catch,
#: timeout, trial_walltime, progress, gang.
Settings = tuple[
    int,
    Mapping[str, float] | None,
    Retries,
    tuple[type[BaseException], ...],
    float | None,
    float | None,
    bool,
    GangOptions | None,
]

#: Figures of the last :func:`run` in this process (driver seconds spent per event), for bench/.
LAST_RUN_STATS: dict[str, float] = {}


def run(
    objective: Callable[[optuna.Trial], Any],
    *,
    n_trials: int,
    client: Client | None = None,
    study: optuna.Study | None = None,
    storage: Any = None,
    study_name: str | None = None,
    direction: str | None = None,
    directions: Sequence[str] | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    resources: Mapping[str, float] | None = None,
    max_retries: int = 2,
    max_resumes: int = 10,
    catch: tuple[type[BaseException], ...] = (Exception,),
    timeout: float | None = None,
    trial_walltime: float | None = None,
    progress: bool = True,
    out: str | None = None,
    workdir: Any = "auto",
    ranks_per_trial: RanksPerTrial = 1,
    placement: str = "pack",
    checkpoint_dir: str | None = None,
    lookahead: int = 1,
    callbacks: Sequence[Callback] = (),
) -> optuna.Study:
    """Run an Optuna search with every worker slot busy until ``n_trials`` trials finished.

    Parameters
    ----------
    objective, n_trials, client
        A plain Optuna objective ``f(trial) -> float``, run on the workers; the finished trials
        (complete, pruned or failed, earlier runs too) the study must hold; a Dask client.
    study, storage, study_name, direction, directions, sampler, pruner
        A study, or what ``optuna.create_study`` makes it from (resumed: its own directions);
        storage: also a URL or a journal file (``./<study_name>.optuna.log``, :mod:`.storage`).
    resources, max_retries, max_resumes, catch
        Dask resources a trial needs (``{"GPU": 1}``: slots count them); the bounds of
        :class:`.dispatch.Retries`; exceptions failing only their trial (others re-raise; none
        completed: :class:`~.records.NoTrialCompleted` names the first failure's cause).
    timeout, trial_walltime, progress, out, lookahead, callbacks
        Seconds after which no trial starts; a trial's likely seconds (:mod:`.walltime`); live
        progress; a results folder; trials queued per slot; ``f(study, trial)`` run here.
    workdir, ranks_per_trial, placement, checkpoint_dir
        The project trials run in (:mod:`clusterkit.runners.workdir`; "auto": the objective
        module's, under the cwd); ranks per trial, an int or a function of the parameters
        (a gang, :mod:`.gang_loop`); "pack" | "spread"; trials' checkpoints (:mod:`.preemption`).
    """
    inputs.check_counts(n_trials, max_retries, lookahead, max_resumes)  # client: get_client()
    made = (objective, storage, study_name, direction, sampler, pruner)
    study = study or inputs.open_study(*made, directions=directions)
    client = client or _default_client()
    gangs_of = gangs.options(ranks_per_trial, placement, checkpoint_dir=_absolute(checkpoint_dir))
    objective, gang, warm = _in_place(client, objective, workdir, gangs_of, checkpoint_dir)
    _check_workers(client, resources)
    retries = Retries(max_retries, max_resumes)
    settings = (n_trials, resources, retries, tuple(catch), timeout, trial_walltime, progress)
    _search(study, client, objective, (*settings, gang), out, warm, lookahead, callbacks)
    return study


def _search(
    study: optuna.Study,
    client: Client,
    objective: Any,
    settings: Settings,
    out: str | None,
    warm: Warmup | None,
    lookahead: int,
    callbacks: Sequence[Callback],
) -> None:
    """Trials a dead driver left running recovered, the search to its end, its results written
    (so far, when it stops: Ctrl-C, SIGTERM, `runs stop`); :class:`~.records.NoTrialCompleted`
    when the study holds no completed trial."""
    from clusterkit.runners.hpo.account import Ledger
    from clusterkit.runners.hpo.gang_account import GangLedger

    inputs.recover_orphans(study)
    ledger = (Ledger if settings[-1] is None else GangLedger)(settings[1])  # the hours, from now
    with report.written_if_stopped(study, out, ledger):
        drive(
            study,
            client,
            objective,
            *settings,
            warm=warm,
            lookahead=lookahead,
            callbacks=callbacks,
            ledger=ledger,
        )
    report.finish(study, out, progress=settings[6], ledger=ledger)
    records.check_completed(study)


def _check_workers(client: Client, resources: Mapping[str, float] | None) -> None:
    """Resources a worker can have, and a worker to run on (waited for)."""
    check_resources(client, resources)
    if slots(client, resources) == 0:
        client.wait_for_workers(1)


def _in_place(
    client: Client,
    objective: Any,
    workdir: Any,
    gang: GangOptions | None,
    checkpoint_dir: str | None,
) -> tuple[Any, GangOptions | None, Warmup | None]:
    """The objective made to run in the project (with its trials' checkpoint folder and
    notice of their worker's end, :mod:`.preemption`); with gangs, the project shipped for
    their ranks to enter, as the training runner's do (the objective itself is sent as it is);
    the warm-up started, if any."""
    from clusterkit.runners.hpo import warmup
    from clusterkit.runners.workdir import in_project, resolve, ship

    project = resolve(workdir, objective)
    if gang is None:  # the workers import while the project ships and the loop starts
        warm = warmup.start(client, objective, project)
        shipped = in_project(client, objective, project)
        folder = _absolute(checkpoint_dir)
        return preemption.Resumable(shipped, folder, preemption.lead()), None, warm
    gang.project = project
    if gang.project is not None:
        ship(client, gang.project)
    return objective, gang, None


def _absolute(url: str | None) -> str | None:
    """A path made absolute here (ranks run elsewhere); a URL as it is."""
    import os

    if url is None or "://" in url:
        return url
    return os.path.abspath(os.path.expanduser(url))


def _default_client() -> Client:
    from clusterkit.client import get_client

    return get_client()


def drive(
    study: optuna.Study,
    client: Client,
    objective: Any,
    n_trials: int,
    resources: Mapping[str, float] | None,
    retries: Retries,
    catch: tuple[type[BaseException], ...],
    timeout: float | None,
    trial_walltime: float | None,
    progress: bool,
    gang: GangOptions | None = None,
    warm: Warmup | None = None,
    lookahead: int = 0,
    callbacks: Sequence[Callback] = (),
    ledger: Any = None,
) -> SearchLoop:
    """Run the loop to its end with the progress display, if asked for, open around it;
    ``warm``, the search's warm-up, unregistered once it ends; ``lookahead``, ``callbacks``:
    see :func:`run`; ``ledger``: the :class:`.account.Ledger` the loop fills (a gang search's:
    a :class:`.gang_account.GangLedger`)."""
    from clusterkit.runners import graceful
    from clusterkit.runners.hpo import warmup
    from clusterkit.runners.hpo.report import ProgressDisplay
    from clusterkit.runners.workdir.pickling import dumps

    display = ProgressDisplay(n_trials) if progress else None
    blob = dumps(objective)
    args = (study, client, blob, n_trials, resources, retries, catch, timeout, display)
    if gang is None:
        search = SearchLoop(*args, lookahead=lookahead, trial_walltime=trial_walltime)
    else:
        from clusterkit.runners.hpo.gang_loop import GangLoop

        search = GangLoop(*args, gang=gang, trial_walltime=trial_walltime)
    search.ledger = ledger or search.ledger
    if display is not None:  # the account so far on the progress line
        display.ledger = search.ledger
    search.order = InOrder(study, callbacks)
    inputs.say_if_done(study, search.done, n_trials)
    setattr(study, "stop", search.side.stop)  # noqa: B010  Optuna's study.stop(), as optimize
    try:
        # SIGTERM from a batch system to a worker: its trials save, then it retires (.graceful)
        with graceful.registered(client):
            search.loop()
        LAST_RUN_STATS.update(overhead_s=search.overhead, trials=search.done)
    finally:
        vars(study).pop("stop", None)
        search.release()  # after the plugin is off: what it starts on the workers takes CPU
        warmup.stop(warm)
        if display is not None:
            display.close()
        if hasattr(objective, "warnings_summary"):  # each warning once, with a count
            objective.warnings_summary("trials")
    return search
