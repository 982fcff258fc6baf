"""Value types of profile fields: sizes, durations and walltimes, parsed with dask's parsers."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema


def _parse_size(value: Any) -> int:
    from dask.utils import parse_bytes

    if isinstance(value, bool):
        raise ValueError(f"expected a size like '24GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a size must be positive, got {value}")
        return value
    if isinstance(value, str):
        try:
            parsed = parse_bytes(value)
        except (ValueError, TypeError):
            raise ValueError(f"expected a size like '24GiB', got {value!r}") from None
        if parsed <= 0:
            raise ValueError(f"a size must be positive, got {value!r}")
        return int(parsed)
    raise ValueError(f"expected a size like '24GiB', got {value!r}")


def _parse_duration(value: Any) -> float:
    from dask.utils import parse_timedelta

    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '90s' or '5m', got {value!r}")
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"expected a duration like '90s' or '5m', got {value!r}") from None
    if seconds is None or seconds <= 0:
        raise ValueError(f"a duration must be positive, got {value!r}")
    if seconds > 365 * 24 * 3600:
        raise ValueError(f"a duration over a year is surely a mistake, got {value!r}")
    return float(seconds)


_WALLTIME = re.compile(r"^(?:(\d+)-)?(\d{1,3}):([0-5]\d):([0-5]\d)$")


def _parse_walltime(value: Any) -> str:
    if not isinstance(value, str) or not _WALLTIME.match(value):
        raise ValueError(f"expected a walltime like '04:00:00' or '1-12:00:00', got {value!r}")
    return value


def walltime_seconds(walltime: str) -> int:
    """'1-02:03:04' -> seconds."""
    match = _WALLTIME.match(walltime)
    if not match:
        raise ValueError(f"not a walltime: {walltime!r}")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


Size = Annotated[
    int,
    BeforeValidator(_parse_size),
    WithJsonSchema({"type": ["string", "integer"], "description": "bytes, or '24GiB'"}),
]
Duration = Annotated[
    float,
    BeforeValidator(_parse_duration),
    WithJsonSchema({"type": ["string", "number"], "description": "seconds, or '90s', '5m'"}),
]
Walltime = Annotated[
    str,
    BeforeValidator(_parse_walltime),
    WithJsonSchema({"type": "string", "pattern": _WALLTIME.pattern}),
]
Port = Annotated[int, Field(ge=0, le=65535)]
