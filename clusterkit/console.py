"""Terminal output. Only this module and ``clusterkit.cli`` write to the terminal."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from clusterkit.errors import ClusterkitError

_stdout: Console | None = None
_stderr: Console | None = None


def out() -> Console:
    """Console for data (stdout)."""
    global _stdout
    if _stdout is None:
        from rich.console import Console

        # piped output is data: never cut a column to an 80-column guess
        width = None if sys.stdout.isatty() else max(int(os.environ.get("COLUMNS") or 0), 200)
        _stdout = Console(highlight=False, soft_wrap=True, width=width)
    return _stdout


def err() -> Console:
    """Console for messages (stderr)."""
    global _stderr
    if _stderr is None:
        from rich.console import Console

        _stderr = Console(stderr=True, highlight=False, soft_wrap=True)
    return _stderr


@contextlib.contextmanager
def spinner(text: str) -> Iterator[None]:
    """A status spinner on stderr, built only once entered (``up`` forks before that: rich's
    import and thread must not come first)."""
    with err().status(text):
        yield


def print_error(error: ClusterkitError) -> None:
    """``error: ...`` on stderr: one line for bad input, plus evidence for runtime failures."""
    details = getattr(error, "details", None)
    text = details() if callable(details) else error.one_line()
    sys.stderr.write(f"error: {text}\n")


def message(text: str) -> None:
    err().print(text)


def warn(text: str) -> None:
    sys.stderr.write(f"warning: {text}\n")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    from rich.table import Table

    grid = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        grid.add_column(column)
    for row in rows:  # cells are data, not markup: "extra [kubernetes]" stays as it is
        grid.add_row(*("" if cell is None else _cell(cell) for cell in row))
    out().print(grid)


def _cell(value: Any) -> Any:
    from rich.markup import escape
    from rich.text import Text

    return value if isinstance(value, Text) else escape(str(value))
