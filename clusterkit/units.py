"""Value types of profile fields: sizes, durations and walltimes, parsed with dask's parsers."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema

from clusterkit.errors import shorten

#: Ceilings: a size or duration above these is surely a typo (and would overflow later).
MAX_SIZE = 2**60  # 1 EiB
MAX_DURATION = 365 * 24 * 3600

_SIZE_EXAMPLE = "expected a size like '24GiB'"
_DURATION_EXAMPLE = "expected a duration like '90s' or '5m'"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_size(value: Any) -> int:
    from dask.utils import parse_bytes

    if isinstance(value, str) and value.strip():
        try:
            parsed = parse_bytes(value.strip())
        except (ValueError, TypeError, OverflowError, IndexError, KeyError):
            raise ValueError(f"{_SIZE_EXAMPLE}, got {shorten(value)}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        parsed = value
    else:
        raise ValueError(f"{_SIZE_EXAMPLE}, got {shorten(value)}")
    if parsed <= 0:
        raise ValueError(f"a size must be positive, got {shorten(value)}")
    if parsed > MAX_SIZE:
        raise ValueError(f"a size over 1 EiB is surely a mistake, got {shorten(value)}")
    return int(parsed)


def _parse_duration(value: Any) -> float:
    from dask.utils import parse_timedelta

    if not (_number(value) or (isinstance(value, str) and value.strip())):
        raise ValueError(f"{_DURATION_EXAMPLE}, got {shorten(value)}")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{_DURATION_EXAMPLE}, got {shorten(value)}")
    if _number(value) and value > MAX_DURATION:
        raise ValueError(f"a duration over a year is surely a mistake, got {shorten(value)}")
    try:
        seconds = parse_timedelta(value.strip() if isinstance(value, str) else value, "seconds")
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError):
        raise ValueError(f"{_DURATION_EXAMPLE}, got {shorten(value)}") from None
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"{_DURATION_EXAMPLE}, got {shorten(value)}")
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, got {shorten(value)}")
    if seconds > MAX_DURATION:
        raise ValueError(f"a duration over a year is surely a mistake, got {shorten(value)}")
    return float(seconds)


_WALLTIME = re.compile(r"^(?:(\d{1,4})-)?(\d{1,3}):([0-5]\d):([0-5]\d)\Z", re.ASCII)


def _parse_walltime(value: Any) -> str:
    if not isinstance(value, str) or not _WALLTIME.match(value):
        raise ValueError(
            f"expected a walltime like '04:00:00' or '1-12:00:00', got {shorten(value)}"
        )
    return value


def walltime_seconds(walltime: str) -> int:
    """'1-02:03:04' -> seconds."""
    match = _WALLTIME.match(walltime)
    if not match:
        raise ValueError(f"not a walltime: {shorten(walltime)}")
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
