"""A search spec whose target is a whole Optuna script (``clusterkit hpo SCRIPT.py -- ARGS``):
checked before anything starts (:func:`prepare`), recorded for a detached run
(:func:`detached`) and run from this process (:func:`run`), the script as ``python SCRIPT.py
ARGS`` would run it, each ``study.optimize`` on the profile's cluster
(:mod:`clusterkit.runners.hpo.script`)."""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.client import DEFAULT_TIMEOUT
from clusterkit.errors import BadInput, ClusterkitError

if TYPE_CHECKING:
    from clusterkit.runs.spec import HpoOptions, RunSpec


@dataclass
class Script:
    """What a script spec names, loaded: the script and its project (None: the script alone)."""

    path: Path
    project: Any


def prepare(spec: RunSpec) -> Script:
    """The script and its project, then the profile (BadInput naming the first that is wrong)."""
    from clusterkit.runs.search import check_profile, scan_project

    options: HpoOptions = spec.options  # type: ignore[assignment]
    path = Path(spec.target)
    if path.suffix != ".py" or not path.is_file():
        raise BadInput(
            f"script {spec.target!r} does not exist",
            hint="clusterkit hpo SCRIPT.py -- ARGS, or FILE.py:FUNC for an objective",
        )
    project = None
    if not options.no_workdir:
        project = scan_project(str(path), options.workdir, options.workdir_max_size)
    check_profile(spec.profile)
    return Script(path, project)


def results_folder(spec: RunSpec) -> str:
    options: HpoOptions = spec.options  # type: ignore[assignment]
    return options.out or f"{Path(spec.target).stem}-results"


def detached(spec: RunSpec, script: Script) -> RunSpec:
    """The spec a detached run records: every path absolute; the progress shown."""
    from clusterkit.runs.search import absolute

    options: HpoOptions = spec.options  # type: ignore[assignment]
    cwd, url, workdir = spec.cwd, options.checkpoint_dir, options.workdir
    profile = spec.profile
    if profile is not None and profile.endswith((".yaml", ".yml")):
        profile = absolute(profile, cwd)
    return spec.replaced(
        target=absolute(spec.target, cwd),
        profile=profile,
        out=absolute(results_folder(spec), cwd),
        checkpoint_dir=url if url is None or "://" in url else absolute(url, cwd),
        workdir=None if options.no_workdir or workdir is None else absolute(workdir, cwd),
        progress=True,
    )


def run(spec: RunSpec, script: Script, attach_timeout: float = DEFAULT_TIMEOUT) -> int:
    """The script run here, its searches on the spec's profile; its exit status as ``python``
    gives it (its own exception: the traceback on stderr, 1). Every search record goes to the
    results folder's ``search.log``; SIGTERM stops it as Ctrl-C does."""
    from clusterkit.client import get_client
    from clusterkit.runners.hpo.script import run_script
    from clusterkit.runs.search_output import search_log, sigterm_stops

    options: HpoOptions = spec.options  # type: ignore[assignment]
    gpus = options.gpus_per_trial
    folder = results_folder(spec)
    with search_log(folder), sigterm_stops():
        client = get_client(spec.profile, timeout=attach_timeout)
        try:
            run_script(
                str(script.path),
                options.script_args,
                client=client,
                resources={"GPU": gpus} if gpus else None,
                trial_walltime=options.trial_walltime,
                out=folder,
                workdir=script.project,
                ranks_per_trial=options.ranks_per_trial,
                checkpoint_dir=options.checkpoint_dir,
                max_retries=options.max_retries,
                max_resumes=options.max_resumes,
                lookahead=options.lookahead,
                progress=options.progress,
            )
        except SystemExit as ended:  # the script's sys.exit(...)
            return _exit_status(ended.code)
        except (ClusterkitError, KeyboardInterrupt):
            raise
        except Exception as error:  # the script's own error, shown as python shows it
            _print_from(error, script.path)
            return 1
        finally:
            client.close()
    return 0


def _print_from(error: BaseException, script: Path) -> None:
    """The traceback from the script's first frame on, as ``python SCRIPT.py`` prints it."""
    tb = error.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__, file=sys.stderr)


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1
