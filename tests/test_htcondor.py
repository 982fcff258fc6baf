"""The htcondor backend's submit descriptions, read by HTCondor's own parser (no live pool).

The ``htcondor`` wheel's bindings (``htcondor2``, with ``CONDOR_CONFIG=ONLY_ENV`` so that no
pool configuration is looked for) parse the description and expand its macros; ``classad2``
parses each ClassAd expression; the worker command inside ``Arguments`` goes to Dask's and
dask-cuda's own parsers as in tests/test_commandlines.py. Nothing here runs condor_submit.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from clusterkit.backends.jobqueue.htcondor import parse_condor_q
from clusterkit.schema import HTCondorProfile
from tests import test_commandlines as C

pytestmark = pytest.mark.htcondor

#: Submit commands whose values are ClassAd expressions.
EXPRESSIONS = ("RequestCpus", "RequestMemory", "RequestDisk", "periodic_remove", "requirements")


@pytest.fixture
def condor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[ModuleType, ModuleType]:
    """(htcondor2, classad2), configured from the environment only; missing fails the tier."""
    monkeypatch.setenv("CONDOR_CONFIG", "ONLY_ENV")
    monkeypatch.setattr(C, "TLS_STAND_INS", tmp_path)
    try:
        import classad2
        import htcondor2
    except ImportError as error:
        pytest.fail(
            f"the htcondor wheel is not installed (pip install 'clusterkit[test]'): {error}"
        )
    return htcondor2, classad2


def condor_arguments(value: str) -> list[str]:
    """``Arguments = "..."`` in HTCondor's new syntax: single quotes group, doubled quotes are
    literal quotes."""
    assert value.startswith('"') and value.endswith('"'), value
    text, args, current, quoted, i = value[1:-1].replace('""', '"'), [], "", False, 0
    while i < len(text):
        char = text[i]
        if char == "'" and quoted and text[i + 1 : i + 2] == "'":
            current, i = current + "'", i + 2
            continue
        if char == "'":
            quoted = not quoted
        elif char.isspace() and not quoted:
            if current:
                args.append(current)
            current = ""
        else:
            current += char
        i += 1
    return [*args, current] if current else args


def htcondor_profile(variant: str, gpus: int, **fields: Any) -> dict[str, Any]:
    data = C.jobqueue_profile("htcondor", variant, gpus)
    del data["queue"]  # HTCondor has none
    return {**data, "processes": 2, "log_directory": "/shared/logs", **fields}


CASES = [(variant, gpus) for variant in C.VARIANTS for gpus in (0, 1)]


@pytest.mark.parametrize("case", CASES, ids=[C.case_id(c) for c in CASES])
def test_submit_description_and_worker_command_parse(
    case: tuple[str, int], condor: tuple[ModuleType, ModuleType], tmp_path: Path
) -> None:
    htcondor2, classad2 = condor
    variant, gpus = case
    data = htcondor_profile(variant, gpus, account="group_a.dask")
    submit = htcondor2.Submit(C.rendered(tmp_path, f"hc-{variant}", data))
    for key in EXPRESSIONS:
        if key in submit:
            classad2.ExprTree(submit[key])  # raises on what HTCondor could not evaluate
    assert submit["batch_name"].startswith(f"ck-hc-{variant}-")
    assert submit.get("request_gpus") == ("2" if gpus else None)
    assert submit["accounting_group"] == "group_a.dask"
    assert submit.expand("Error") == "/shared/logs/worker-1.0.err"
    flag, command = condor_arguments(submit["Arguments"])
    assert flag == "-c"
    *exports, worker = command.split("; ")
    for line in exports:
        variable = line.removeprefix("export ").split("=", 1)[0]
        assert not variable.startswith("DASK_") or C.dask_config_key(variable), line
    module, ctx = C.parse_python(shlex.split(worker.replace("<cluster-dir>", str(tmp_path))))
    assert module == ("dask_cuda.cli" if gpus else "distributed.cli.dask_worker")
    scheme = C.VARIANTS[variant].get("protocol", "tls")
    assert ctx.params["protocol"] == f"{scheme}://"
    assert ("GPU=1" in (ctx.params["resources"] or "")) == bool(gpus)
    if scheme == "tls":
        assert ctx.params["tls_key"].endswith("worker-key.pem")


def test_walltime_is_a_periodic_remove_above_the_worker_lifetime(
    condor: tuple[ModuleType, ModuleType], tmp_path: Path
) -> None:
    htcondor2, _ = condor
    data = htcondor_profile("default", 0, walltime="02:00:00", job_extra=['+Site = "x"'])
    submit = htcondor2.Submit(C.rendered(tmp_path, "hc-walltime", data))
    assert "time() - EnteredCurrentStatus > 7200" in submit["periodic_remove"]
    assert submit["MY.Site"] == '"x"'  # HTCondor reads +Site as MY.Site
    (_, command) = condor_arguments(submit["Arguments"])
    assert "--lifetime 6600s" in command  # below the 7200 s the expression allows


def test_malformed_descriptions_are_refused(
    condor: tuple[ModuleType, ModuleType], tmp_path: Path
) -> None:
    htcondor2, classad2 = condor
    with pytest.raises(ValueError):
        htcondor2.Submit("this is not a submit command\nQueue\n")
    data = htcondor_profile("default", 0, job_extra=["requirements = (Arch == "])
    submit = htcondor2.Submit(C.rendered(tmp_path, "hc-broken", data))
    with pytest.raises(Exception, match="parse"):
        classad2.ExprTree(submit["requirements"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"queue": "long"}, "no queues"), ({"job_extra": ["-l foo"]}, "not a submit command")],
)
def test_profile_rejects(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HTCondorProfile.model_validate({"backend": "htcondor", **fields})


def test_condor_q_states_and_hold_reasons() -> None:
    text = (
        "12.0 2 slot1@node7 undefined\n"
        "13.0 5 undefined Job held by user\n"
        "14.0 4 undefined undefined\n"
    )
    jobs = parse_condor_q(text)
    assert sorted(jobs) == ["12.0", "13.0"]  # completed jobs are gone
    assert (jobs["12.0"].state, jobs["12.0"].nodes) == ("Running", "slot1@node7")
    assert (jobs["13.0"].state, jobs["13.0"].reason) == ("Held", "Job held by user")
