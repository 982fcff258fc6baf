"""Start-up cost without timing it: what quick commands and the attach path leave unimported.

Each check runs in a fresh interpreter and lists the heavy modules in ``sys.modules`` after
the work is done; a module that shows up there is start-up time every user pays.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

#: What no quick command needs. (typer itself imports pydantic to coerce the arguments of
#: any command it runs, so pydantic is held to this only where typer does not run one.)
HEAVY = ("distributed", "dask", "optuna", "torch", "clusterkit.schema")

REPORT = """
import sys
heavy = {heavy!r}
print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy)))
"""


def imported_after(code: str, heavy: tuple[str, ...], **env: str) -> list[str]:
    """The modules of ``heavy`` that a fresh interpreter holds after running ``code``."""
    script = textwrap.dedent(code) + REPORT.format(heavy=heavy)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    return [name.strip(" '") for name in last.strip("[]").split(",") if name.strip()]


RUN_CLI = """
import contextlib, io
from clusterkit.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    with contextlib.suppress(SystemExit):
        main({argv!r})
"""


def test_help_imports_nothing_heavy() -> None:
    code = RUN_CLI.format(argv=["--help"])
    assert imported_after(code, (*HEAVY, "pydantic", "yaml")) == []


@pytest.mark.parametrize(
    "argv",
    [["up", "--help"], ["profiles", "--help"], ["runs", "--help"], ["--version"]],
)
def test_quick_commands_import_no_cluster_library(argv: list[str]) -> None:
    assert imported_after(RUN_CLI.format(argv=argv), HEAVY) == []


@pytest.mark.parametrize("argv", [["ls"], ["ls", "--json"], ["status", "nope"]])
def test_commands_that_name_a_cluster_load_no_profile(argv: list[str], tmp_path: Path) -> None:
    """With no cluster up, `ls` and `status` read the state directory only: no profile
    schema, no YAML, no cluster library."""
    code = RUN_CLI.format(argv=argv)
    found = imported_after(code, (*HEAVY, "yaml"), CLUSTERKIT_STATE_DIR=str(tmp_path))
    assert found == []


@pytest.mark.parametrize(
    ("words", "cword"), [("clusterkit up lo", "2"), ("clusterkit down x", "2")]
)
def test_completion_imports_no_cluster_library(words: str, cword: str) -> None:
    code = """
    import contextlib, io
    from clusterkit.cli import app
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        app(prog_name="clusterkit")
    """
    env = {"_CLUSTERKIT_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
    assert imported_after(code, (*HEAVY, "yaml"), **env) == []


def test_attaching_by_record_imports_no_backend_or_schema() -> None:
    """get_client(NAME) reads the record and makes a plain Client: the backend module (and
    with it the profile schema) stays unimported. The Client is a stub here."""
    code = """
    import distributed
    from clusterkit.backends.base import attach
    from clusterkit.state import ClusterRecord

    distributed.Client = lambda *args, **kwargs: (args, kwargs)
    record = ClusterRecord(name="x", backend="local", profile="local", profile_source=None,
                           digest="", address="tcp://127.0.0.1:1", dashboard=None, pid=None,
                           security={}, min_workers=1)
    (address,), kwargs = attach(record, timeout=1)
    assert address == "tcp://127.0.0.1:1" and kwargs["timeout"] == 1
    """
    heavy = ("clusterkit.schema", "clusterkit.backends.local", "clusterkit.profiles", "pydantic")
    assert imported_after(code, heavy) == []


EXIT_STATE = """
import atexit, gc, sys
from clusterkit import cli
# registered before the command's own hooks, so it runs after them, last: what the
# interpreter's final collection will find frozen (skipped), and what `up` reads
atexit.register(lambda: print(gc.get_freeze_count() > 0, cli.PROCESS_ENDS_WITH_COMMAND))
sys.argv = ["clusterkit", "profiles", "list"]
try:
    cli.{entry}()
except SystemExit:
    pass
"""


@pytest.mark.parametrize(("entry", "frozen"), [("program", "True True"), ("main", "False False")])
def test_only_the_command_process_skips_the_final_collection(entry: str, frozen: str) -> None:
    """The ``clusterkit`` command ends without the interpreter's last garbage collection (and
    `up` without distributed's exit hooks); ``main()`` inside another program changes
    neither for that program's process."""
    done = subprocess.run(
        [sys.executable, "-c", EXIT_STATE.format(entry=entry)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "local" in done.stdout  # the command itself ran and printed in full
    assert done.stdout.strip().splitlines()[-1] == frozen

