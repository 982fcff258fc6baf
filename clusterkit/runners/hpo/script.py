"""An Optuna script run as written: ``python script.py``, its searches on the cluster.

:func:`run_script` runs the script as ``python script.py ARGS`` would (``__main__``, its
``sys.argv``, its directory first on ``sys.path``) while :func:`searches_on` stands in for
``optuna.study.Study.optimize``: every ``study.optimize(...)`` the script makes, its own or a
library's (``OptunaSearchCV``), runs its trials through :func:`clusterkit.runners.hpo.run` on
the cluster, every slot busy, with Optuna's meaning of ``n_trials`` (trials of this call),
``timeout``, ``callbacks`` and ``catch``. ``n_jobs`` is the cluster's: another value is said
once and otherwise ignored; ``gc_after_trial`` is the workers' business. What the script does
with the study afterwards (its prints, its plots, its files) runs here as it would.
"""

from __future__ import annotations

import contextlib
import logging
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from clusterkit.errors import BadInput

logger = logging.getLogger(__name__)

#: ``n_trials`` when the script gives none: the search runs until its timeout, a
#: ``study.stop()``, Ctrl-C or SIGTERM, as ``study.optimize`` does.
UNBOUNDED = 2**62


@contextlib.contextmanager
def searches_on(client: Any, **options: Any) -> Iterator[list[Any]]:
    """While inside: ``Study.optimize`` runs its trials on ``client``'s cluster, with the
    :func:`~clusterkit.runners.hpo.run` ``options`` given here (resources, retries, the
    results folder, ...); yields the studies searched so far."""
    import optuna

    from clusterkit.runners.hpo import driver, inputs
    from clusterkit.runners.hpo.records import NoTrialCompleted

    original = optuna.study.Study.optimize
    searched: list[Any] = []

    def optimize(
        study: optuna.Study,
        func: Callable[[optuna.Trial], Any],
        n_trials: int | None = None,
        timeout: float | None = None,
        n_jobs: int = 1,
        catch: Any = (),
        callbacks: Sequence[Callable[..., None]] | None = None,
        gc_after_trial: bool = False,
        show_progress_bar: bool = False,
    ) -> None:
        if n_jobs != 1:
            logger.warning("study.optimize(n_jobs=%s): the cluster's slots run the trials", n_jobs)
        held = sum(inputs.counted(t) for t in study.get_trials(deepcopy=False))
        total = held + (UNBOUNDED if n_trials is None else n_trials)
        caught = tuple(catch) if isinstance(catch, list | tuple) else (catch,)
        searched.append(study)
        try:
            driver.run(
                func,
                n_trials=total,
                client=client,
                study=study,
                timeout=timeout,
                catch=caught,
                callbacks=list(callbacks or ()),
                **{"progress": show_progress_bar, **options},
            )
        except NoTrialCompleted as error:  # optimize returns; the study says how trials ended
            logger.warning("%s", error)

    optuna.study.Study.optimize = optimize  # type: ignore[method-assign,assignment]
    try:
        yield searched
    finally:
        optuna.study.Study.optimize = original  # type: ignore[method-assign]


def run_script(
    path: str, argv: Sequence[str] = (), *, client: Any = None, **options: Any
) -> list[Any]:
    """Run the Optuna script at ``path`` with ``argv`` as ``python path argv`` would, every
    ``study.optimize`` in it on ``client``'s cluster (default :func:`~clusterkit.get_client`);
    the studies it searched. ``options``: :func:`searches_on`'s."""
    script = Path(path)
    if not script.is_file() or script.suffix != ".py":
        raise BadInput(f"{path!r} is no Python script", hint="clusterkit hpo SCRIPT.py -- ARGS")
    if client is None:
        from clusterkit.client import get_client

        client = get_client()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        with searches_on(client, **options) as searched:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return searched
