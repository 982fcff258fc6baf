"""The typer app: thin commands over the library, and the one error boundary.

Command modules import only typer at top level; each command imports what it needs when it
runs, so ``clusterkit --help`` and ``clusterkit profiles ...`` never import distributed or torch.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
from typing import Any, NoReturn

import typer

from clusterkit import __version__

#: Modules that define ``register(app)``; each adds its commands.
COMMAND_MODULES = (
    "clusterkit.cli.profiles",
    "clusterkit.cli.cluster",
    "clusterkit.cli.doctor",
    "clusterkit.cli.train",
    "clusterkit.cli.hpo",
    "clusterkit.cli.runs",
)

app = typer.Typer(
    name="clusterkit",
    help="Bring Dask clusters up from named profiles and run ML work on them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _flags_without_type() -> None:
    """Newer typer (0.29 here) puts ``<bool>`` beside every flag in rich help, ``--help``
    included, as if it took a value; click's plain help and older typer show none. Here
    neither does rich help (a typer that fixes this is left as it is)."""
    from typer.core import TyperOption

    typed = getattr(TyperOption, "display_type_rich", None)
    if typed is None or getattr(typed, "flags_without_type", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else typed(self, ctx)

    display_type_rich.flags_without_type = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_type()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"clusterkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """clusterkit: Dask clusters from named profiles."""


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


#: True in the ``clusterkit`` command's own process (``program``), False where ``main()`` runs
#: inside another program's process (tests, a detached run's driver)
PROCESS_ENDS_WITH_COMMAND = False


def program() -> None:
    """The ``clusterkit`` command: ``main()`` in a process that ends with it.

    Its exit skips the interpreter's last garbage collection, a sixth of a command as short as
    ``ls`` (gc.freeze, run after every other exit hook: what is left is freed with the
    process). Only here: ``main()`` also runs inside other programs' processes.
    """
    global PROCESS_ENDS_WITH_COMMAND
    PROCESS_ENDS_WITH_COMMAND = True
    atexit.register(gc.freeze)
    main()


def main(argv: list[str] | None = None) -> None:
    """Entry point with the single error boundary: ``error: ...``, exit 2 (input) or 1."""
    from clusterkit.errors import ClusterkitError

    try:
        code = app(args=argv, prog_name="clusterkit", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)  # click returns typer.Exit's code when not in standalone mode
    except ClusterkitError as error:
        if os.environ.get("CLUSTERKIT_DEBUG"):
            raise
        from clusterkit.console import print_error

        print_error(error)
        sys.exit(error.exit_code)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as error:  # click usage errors and friends
        if not _is_click_error(error) or os.environ.get("CLUSTERKIT_DEBUG"):
            raise
        _exit_on_click_error(error)


def _is_click_error(error: BaseException) -> bool:
    """A click exception, whether from click or the copy typer bundles (``typer._click``).

    typer vendors click, so ``click.ClickException`` does not match what typer raises; both
    share the interface used here.
    """
    return callable(getattr(error, "format_message", None)) and isinstance(
        getattr(error, "exit_code", None), int
    )


def _exit_on_click_error(error: Any) -> NoReturn:
    """One line, ``error: ...`` naming the command and where its help is; click's exit code.

    A group called without a command prints its help (stdout, exit 0) rather than an error.
    """
    ctx = getattr(error, "ctx", None)
    if any(cls.__name__ == "NoArgsIsHelpError" for cls in type(error).__mro__):
        typer.echo(error.format_message())
        sys.exit(0)
    from clusterkit.errors import cut

    text = cut(" ".join(str(error.format_message()).split()), 200)  # echoed arguments: cut
    if ctx is not None:
        text += f" (see '{ctx.command_path} --help')"
    sys.stderr.write(f"error: {text}\n")
    sys.exit(error.exit_code)
