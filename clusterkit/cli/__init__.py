"""The typer app: thin commands over the library, and the one error boundary.

Command modules import only typer at top level; each command imports what it needs when it
runs, so ``clusterkit --help`` and ``clusterkit profiles ...`` never import distributed or torch.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from clusterkit import __version__

#: Modules that define ``register(app)``; each adds its commands.
COMMAND_MODULES = (
    "clusterkit.cli.profiles",
    "clusterkit.cli.cluster",
    "clusterkit.cli.doctor",
    "clusterkit.cli.train",
    "clusterkit.cli.hpo",
)

app = typer.Typer(
    name="clusterkit",
    help="Bring Dask clusters up from named profiles and run ML work on them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


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
        import click

        if isinstance(error, click.ClickException):
            error.show()
            sys.exit(2 if isinstance(error, click.UsageError) else 1)
        raise
