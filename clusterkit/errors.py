"""Exception hierarchy: every error names the thing, the value and the fix."""

from __future__ import annotations

from collections.abc import Sequence

#: Exit codes used by the CLI's single error boundary.
EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 1


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
    """Input the user can fix: a bad argument, a missing file, an unknown name."""

    exit_code = EXIT_BAD_INPUT


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
        field = f"{self.field}: " if self.field else ""
        text = f"{where}{field}{self.message}"
        return f"{text} ({self.hint})" if self.hint else text


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
