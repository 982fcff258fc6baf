"""Discover, load (``yamlmap``), resolve ``extends`` and ``${ENV}``, validate -> profile model."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clusterkit import siteconfig
from clusterkit.errors import ProfileError, ProfileNotFound, shorten
from clusterkit.errors import cut as cut_text
from clusterkit.schema import ProfileCommon
from clusterkit.searchpath import SUFFIXES, check_name, discover, search_path
from clusterkit.yamlmap import Located, Path_, display, dotted, read_file

#: The public name of a loaded profile: the backend's pydantic model.
Profile = ProfileCommon

MAX_EXTENDS_DEPTH = 16

_ENV = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def is_path(ref: str | os.PathLike[str]) -> bool:
    """A ref is a file path when it names a YAML file; anything else must be a plain name."""
    return isinstance(ref, os.PathLike) or os.fspath(ref).endswith(SUFFIXES)


def find(ref: str | os.PathLike[str]) -> Path:
    """The file for a profile name or path."""
    text = os.fspath(ref)
    if is_path(text):
        path = Path(text)
        try:
            found = path.is_file()
        except OSError:  # a name too long for the filesystem, say
            found = False
        if not found:
            raise ProfileNotFound(f"no profile file {shorten(text)}")
        return path
    check_name(text)
    for directory in search_path():
        for suffix in SUFFIXES:
            candidate = directory / f"{text}{suffix}"
            if candidate.is_file():
                return candidate
    close = closest_name(text, sorted(discover()))
    hint = f"did you mean '{close}'?" if close else "see `clusterkit profiles list`"
    raise ProfileNotFound(f"no profile named '{text}'", hint=hint)


def closest_name(name: str, known: list[str]) -> str | None:
    """The known profile nearest to ``name``: the same words reordered, else a close spelling."""
    words = sorted(re.split(r"[-_.]", name.lower()))
    for candidate in known:
        if sorted(re.split(r"[-_.]", candidate.lower())) == words:
            return candidate  # gpu-slurm -> slurm-gpu
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


# ------------------------------------------------------------------ extends, ${ENV}


def _merge(base: Located, child: Located) -> Located:
    """Deep-merge mappings; the child wins; lists and scalars are replaced whole."""

    def merge(a: Any, b: Any, path: Path_, lines: dict[Path_, tuple[str, int]]) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            result = dict(a)
            for key, value in b.items():
                result[key] = merge(a.get(key), value, (*path, key), lines) if key in a else value
            return result
        # replaced: drop the base's lines below this path
        for key in [k for k in lines if k[: len(path)] == path and len(k) > len(path)]:
            del lines[key]
        return b

    lines = dict(base.lines)
    data = merge(base.data, child.data, (), lines)
    lines.update(child.lines)
    return Located(data, lines)


def _resolve_extends(path: Path, chain: tuple[Path, ...] = ()) -> Located:
    resolved = path.resolve()
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise ProfileError(
            f"`extends` is nested deeper than {MAX_EXTENDS_DEPTH}", file=display(path)
        )
    located = read_file(path)
    parent_ref = located.data.pop("extends", None)
    if parent_ref is None:
        return located
    file, line = located.lines[("extends",)]
    if not isinstance(parent_ref, str) or not parent_ref:
        raise ProfileError(
            "expected the name of another profile", file=file, line=line, field="extends"
        )
    try:
        parent_path = _find_parent(parent_ref, path)
    except ProfileError as error:
        raise ProfileError(
            error.message, file=file, line=line, field="extends", hint=error.hint
        ) from None
    if parent_path.resolve() in (*chain, resolved):
        cycle = " -> ".join(p.stem for p in (*chain, resolved, parent_path.resolve()))
        raise ProfileError(
            f"`extends` forms a cycle: {cycle}", file=file, line=line, field="extends"
        )
    parent = _resolve_extends(parent_path, (*chain, resolved))
    return _merge(parent, located)


def _find_parent(ref: str, child: Path) -> Path:
    """A parent named in `extends`: a sibling file first, then the search path."""
    if not is_path(ref):
        check_name(ref)
        for suffix in SUFFIXES:
            sibling = child.parent / f"{ref}{suffix}"
            if sibling.is_file():
                return sibling
    elif not Path(ref).is_absolute():
        candidate = child.parent / ref
        if candidate.is_file():
            return candidate
    return find(ref)


def _interpolate(located: Located) -> None:
    """Replace ${VAR} and ${VAR:-default} in every string; `$$` is a literal `$`."""

    def substitute(text: str, path: Path_) -> str:
        def one(match: re.Match[str]) -> str:
            if match.group(0) == "$$":
                return "$"
            name, default = match.group(1), match.group(2)
            value = os.environ.get(name)
            if value is None or (value == "" and default is not None):
                if default is not None:
                    return default
                file, line = located.lines.get(path, (None, None))
                shown = cut_text(name)
                raise ProfileError(
                    f"environment variable {shown} is not set",
                    file=file,
                    line=line,
                    field=dotted(path),
                    hint=f"export {shown}=... or write ${{{shown}:-default}}",
                )
            return value

        return _ENV.sub(one, text)

    def walk(value: Any, path: Path_) -> Any:
        if isinstance(value, str):
            return substitute(value, path)
        if isinstance(value, dict):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, (*path, i)) for i, v in enumerate(value)]
        return value

    located.data = walk(located.data, ())


# ------------------------------------------------------------------ validation


def _walk_model_fields(model: type[Any], loc: tuple[Any, ...]) -> list[str]:
    """Field names valid at ``loc`` inside ``model`` (for did-you-mean)."""
    from pydantic import BaseModel

    current: Any = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        info = getattr(current, "model_fields", {}).get(part)
        if info is None:
            return []
        annotation = info.annotation
        current = None
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                current = candidate
                break
            for inner in getattr(candidate, "__args__", ()) or ():
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    current = inner
    return list(getattr(current, "model_fields", {})) if current is not None else []


_UNION_MEMBER = re.compile(r"[\[\(]|^(int|float|str|bool|none|list|dict)$")


def _clean_loc(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """Drop pydantic's union-member labels (``function-before[...]``, ``int``) from a loc.

    A part that is a key of the profile's data where it stands is kept, whatever its name.
    """
    kept: list[Any] = []
    for part in loc:
        in_list = isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        if in_list or (isinstance(data, dict) and part in data):
            data = data[part]
        elif isinstance(part, int) or not _UNION_MEMBER.search(str(part)):
            data = None
        else:
            continue
        kept.append(part)
    return tuple(kept)


def _friendly(
    error: dict[str, Any], model: type[Any], loc: tuple[Any, ...]
) -> tuple[str, str | None]:
    kind = error["type"]
    value = shorten(error.get("input"))
    if kind == "extra_forbidden":
        fields = _walk_model_fields(model, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]) if loc else "", fields, n=1)
        if len(loc) == 1 and "cuda" in fields and _is_cuda_option(str(loc[0]), model):
            return "unknown field", f"a dask-cuda option: write it under `cuda:` ({loc[0]}: ...)"
        known = ", ".join(sorted(fields))
        if len(known) > 120:
            known = f"{cut_text(known, 120)} (see `clusterkit profiles schema`)"
        return "unknown field", f"did you mean '{close[0]}'?" if close else f"known fields: {known}"
    if kind == "missing":
        return "required field is missing", None
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        choices = re.findall(r"'([^']*)'", expected)
        close = difflib.get_close_matches(str(error.get("input")), choices, n=1)
        return (
            f"expected one of {expected}, got {value}",
            f"did you mean '{close[0]}'?" if close else None,
        )
    if kind == "value_error":
        return str(error["msg"]).removeprefix("Value error, "), None
    if kind in {"string_pattern_mismatch"}:
        return f"{value} has the wrong form", None
    ctx = error.get("ctx", {})
    bounds = {
        "greater_than_equal": ("at least", "ge"),
        "greater_than": ("above", "gt"),
        "less_than_equal": ("at most", "le"),
        "less_than": ("below", "lt"),
    }
    if kind in bounds:
        word, key = bounds[kind]
        return f"must be {word} {ctx.get(key)}, got {value}", None
    expected = {
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
        "string": "a string",
        "list": "a list",
        "dict": "a mapping",
        "model": "a mapping",
    }
    for prefix, noun in expected.items():
        if kind.startswith(prefix + "_") or kind == f"{prefix}_type":
            return f"expected {noun}, got {value}", None
    if kind in {"too_short", "too_long"}:
        return str(error["msg"]).lower(), None
    message = str(error["msg"])
    return message[0].lower() + message[1:], None


def _is_cuda_option(name: str, model: Any) -> bool:
    from clusterkit.schema import cuda

    local = getattr(model, "CUDA_CLUSTER_KEYWORDS", False)
    known = cuda.cluster_options() if local else cuda.worker_parameters()
    return bool(known) and name in known  # type: ignore[operator]


def validate(located: Located, name: str, source: str) -> ProfileCommon:
    from pydantic import ValidationError

    from clusterkit.registry import BUILTIN, names, profile_model

    data = located.data
    backend = data.get("backend")
    # entry points are read only when needed: importlib.metadata takes ~20 ms a call
    known = list(BUILTIN) if isinstance(backend, str) and backend in BUILTIN else names()
    file, line = located.lines.get(("backend",), (source, 1))
    if backend is None:
        raise ProfileError(
            "required field is missing",
            file=source,
            line=1,
            field="backend",
            hint=f"one of: {', '.join(known)}",
        )
    if not isinstance(backend, str) or backend not in known:
        close = difflib.get_close_matches(str(backend), known, n=1)
        raise ProfileError(
            f"unknown backend {shorten(backend)}",
            file=file,
            line=line,
            field="backend",
            hint=f"did you mean '{close[0]}'?" if close else f"one of: {', '.join(known)}",
        )
    model = profile_model(backend)
    located.filled = siteconfig.fill(data, backend)
    try:
        profile = model.model_validate(data)
    except ValidationError as error:
        errors: list[Any] = list(error.errors(include_url=False))

        def line_of(err: dict[str, Any]) -> int:
            return _line_for(located, _clean_loc(tuple(err["loc"]), data))[1] or 0

        first = min(errors, key=line_of)
        loc = _clean_loc(tuple(first["loc"]), data)
        where_file, where_line = _line_for(located, loc)
        message, hint = _friendly(first, model, loc)
        if loc and loc[0] in located.filled:  # the value came from the site's Dask config
            message = f"{message} (from Dask config {located.filled[loc[0]]})"
        raise ProfileError(
            message, file=where_file or source, line=where_line, field=dotted(loc), hint=hint
        ) from None
    return profile.named(name, source)


def _line_for(located: Located, loc: tuple[Any, ...]) -> tuple[str | None, int | None]:
    for cut in range(len(loc), -1, -1):
        hit = located.lines.get(loc[:cut])
        if hit:
            return hit
    return None, None


# ------------------------------------------------------------------ public


def load_profile(ref: str | os.PathLike[str] | ProfileCommon | None = None) -> ProfileCommon:
    """Load and validate a profile by name (search path) or path; None means ``local``."""
    if isinstance(ref, ProfileCommon):
        return ref
    if ref is None:
        ref = os.environ.get("CLUSTERKIT_PROFILE") or "local"
    return load_located(ref)[0]


def load_located(ref: str | os.PathLike[str]) -> tuple[ProfileCommon, Located]:
    """The profile and where each of its settings was written (``profiles render --explain``)."""
    path = find(ref)
    located = _resolve_extends(path)
    _interpolate(located)
    return validate(located, path.stem, display(path)), located


def resolved_data(ref: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping after extends and interpolation (what `profiles show` prints)."""
    profile = load_profile(ref)
    return {"backend": profile.backend_name, **profile.model_dump(mode="json", exclude={"backend"})}


def iter_profiles() -> Iterator[tuple[str, Path]]:
    yield from discover().items()
