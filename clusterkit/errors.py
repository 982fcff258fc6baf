"""Exception hierarchy: every error names the thing, the value and the fix."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

#: Exit codes used by the CLI's single error boundary.
EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 1

#: Bad input is reported in one line of at most this many characters.
MAX_LINE = 300
#: An echoed value (or field name) is cut to this many characters.
MAX_ECHO = 60

_LINE_BREAKS = re.compile(r"[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def cut(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` at most ``limit`` characters, the cut marked with '...'."""
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def shorten(value: Any, limit: int = MAX_ECHO) -> str:
    """The repr of a bad value for a message: one line, at most ``limit`` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (sys.set_int_max_str_digits)
        text = f"<an integer of {value.bit_length()} bits>"
    return cut(printable(text), limit)


def printable(text: str) -> str:
    """``text`` with line breaks and other control characters escaped (a name in a message)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def fit(text: str, limit: int = MAX_LINE) -> str:
    """The last guard of bad-input messages: one line, at most ``limit`` characters."""
    return cut(_LINE_BREAKS.sub(" ", text), limit)


class ClusterkitError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with when this reaches it."""

    exit_code: int = EXIT_RUNTIME

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class BadInput(ClusterkitError):
    """Input the user can fix: a bad argument, a missing file, an unknown name.

    Its ``one_line()`` is one line of at most ``MAX_LINE`` characters, whatever it echoes.
    """

    exit_code = EXIT_BAD_INPUT

    def one_line(self) -> str:
        return fit(super().one_line())


class ProfileError(BadInput):
    """A profile that cannot be loaded or validated, located to file, line and field."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.file = file
        self.line = line
        self.field = field
        super().__init__(message, hint=hint)

    def one_line(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        field = f"{cut(printable(self.field), 2 * MAX_ECHO)}: " if self.field else ""
        text = f"{where}{field}{self.message}"
        return fit(f"{text} ({self.hint})" if self.hint else text)


class ProfileNotFound(ProfileError):
    """No profile of that name on the search path."""


class BackendUnavailable(BadInput):
    """The profile's backend needs a library that is not installed."""

    def __init__(self, profile: str, package: str, extra: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(
            f"profile '{profile}' needs {package}",
            hint=f"pip install 'clusterkit[{extra}]'",
        )


class CapabilityMissing(BadInput):
    """The profile asks for something its backend cannot do (e.g. UCX over SSH without ucxx)."""


class ClusterExists(BadInput):
    """``up`` of a name that is already up."""


class ClusterNotFound(BadInput):
    """A verb on a name that is not up."""


class StateError(ClusterkitError):
    """The state directory cannot be written (read-only, full, permissions)."""


class ClusterStartError(ClusterkitError):
    """Workers or scheduler did not come up. Carries the component and the evidence."""

    def __init__(
        self,
        message: str,
        *,
        component: str,
        evidence: Sequence[str] = (),
        hint: str | None = None,
    ) -> None:
        self.component = component
        self.evidence = list(evidence)
        super().__init__(f"{component}: {message}", hint=hint)

    def details(self) -> str:
        """The message followed by the evidence (last lines of stderr / logs), indented."""
        if not self.evidence:
            return self.one_line()
        tail = "\n".join(f"  | {line}" for line in self.evidence)
        return f"{self.one_line()}\n{tail}"
