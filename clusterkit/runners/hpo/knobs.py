"""The study's knobs by Optuna's names, as Optuna's CLI takes them: its directions
(``--directions minimize maximize``), a sampler and a pruner from a class name and JSON keyword
arguments (``--sampler TPESampler --sampler-kwargs '{"multivariate": true}'``).

A sampler or pruner another one takes (``wrapped_pruner`` of PatientPruner, ``base_sampler`` of
PartialFixedSampler, ``independent_sampler``) is given by name, or as ``{"name": NAME,
"kwargs": {...}}``: ``--pruner PatientPruner --pruner-kwargs '{"wrapped_pruner": {"name":
"MedianPruner", "kwargs": {"n_warmup_steps": 5}}, "patience": 2}'``. Each mistake is one
BadInput line naming the flag (and, for a name, the valid ones).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from clusterkit.errors import BadInput, shorten

#: What each objective of a study may be.
DIRECTIONS = ("minimize", "maximize")
#: Parameters of a sampler or pruner that take another one: what it is.
NESTED = {"independent_sampler": "sampler", "base_sampler": "sampler", "wrapped_pruner": "pruner"}


def check_directions(
    direction: Sequence[str] | None, directions: Sequence[str] | None
) -> tuple[str, ...] | None:
    """The study's directions from ``--direction`` (once at most: a second one is refused, not
    taken over the first) or ``--directions`` (not both); None when neither is given."""
    direction, directions = list(direction or ()), list(directions or ())
    if direction and directions:
        raise BadInput(
            "--direction and --directions both given: give --directions alone "
            "(--directions minimize maximize, one per objective)"
        )
    if len(direction) > 1:
        raise BadInput(
            f"--direction given {len(direction)} times ({' '.join(direction)}): a study of "
            f"several objectives takes --directions {' '.join(direction)}"
        )
    given, flag = (direction, "--direction") if direction else (directions, "--directions")
    for value in given:
        if value not in DIRECTIONS:
            raise BadInput(f"{flag} must be minimize or maximize, got {shorten(value)}")
    return tuple(given) or None


def study_directions(direction: Any, directions: Sequence[Any] | None) -> list[str] | None:
    """What ``hpo.run`` and ``optuna.create_study`` take, ``direction`` or ``directions`` (not
    both), as names ("minimize", "maximize"; a StudyDirection too); None when neither."""
    if direction is not None and directions is not None:
        raise BadInput("give direction or directions, not both (directions: one per objective)")
    if isinstance(directions, str):
        raise BadInput(
            f"directions takes a list, e.g. ['minimize', 'maximize'], got {shorten(directions)}"
        )
    given = [direction] if direction is not None else directions
    if given is None:
        return None
    found = [str(getattr(d, "name", d)).lower() for d in given]
    for value, name in zip(given, found, strict=True):
        if name not in DIRECTIONS:
            raise BadInput(f"a direction must be minimize or maximize, got {shorten(value)}")
    if not found:
        raise BadInput("directions takes one or more of minimize, maximize")
    return found


def names(kind: str) -> list[str]:
    """The classes Optuna offers as ``kind`` ("sampler" or "pruner"), by name."""
    module, base = _module(kind)
    found = []
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name, None)
        if not isinstance(value, type) or inspect.isabstract(value):
            continue
        if issubclass(value, base) and not name.startswith("Base"):
            found.append(name)
    return sorted(found)


def make_sampler(name: str | None, kwargs: Mapping[str, Any] | None = None) -> Any:
    """``optuna.samplers.<name>(**kwargs)``; None without a name (Optuna's default)."""
    return _make("sampler", ("--sampler", "--sampler-kwargs"), name, kwargs)


def make_pruner(name: str | None, kwargs: Mapping[str, Any] | None = None) -> Any:
    """``optuna.pruners.<name>(**kwargs)``; None without a name (Optuna's default)."""
    return _make("pruner", ("--pruner", "--pruner-kwargs"), name, kwargs)


def _module(kind: str) -> tuple[Any, type]:
    import optuna

    if kind == "sampler":
        return optuna.samplers, optuna.samplers.BaseSampler
    return optuna.pruners, optuna.pruners.BasePruner


def _make(
    kind: str, flags: tuple[str, str], name: str | None, kwargs: Mapping[str, Any] | None
) -> Any:
    """An instance of Optuna's class ``name`` of ``kind``; ``flags``: where the name and the
    keyword arguments were given, for the messages."""
    flag, kwargs_flag = flags
    if name is None:
        if kwargs:
            raise BadInput(f"{kwargs_flag} needs {flag} NAME")
        return None
    valid = names(kind)
    if name not in valid:
        raise BadInput(f"{flag} {shorten(name)} is not one of Optuna's {kind}s: {', '.join(valid)}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise BadInput(f"{kwargs_flag} must be a JSON object, got {shorten(kwargs)}")
    cls = getattr(_module(kind)[0], name)
    arguments = {key: _nested(kwargs_flag, key, value) for key, value in kwargs.items()}
    try:
        with warnings.catch_warnings():  # asked for by name: no "experimental" line each run
            from optuna.exceptions import ExperimentalWarning

            warnings.simplefilter("ignore", ExperimentalWarning)
            return cls(**arguments)
    except (TypeError, ValueError) as error:
        takes = ", ".join(inspect.signature(cls).parameters) or "no arguments"
        raise BadInput(
            f"{kwargs_flag} for {name}: {error}", hint=f"{name} takes: {takes}"
        ) from None
    except ImportError as error:
        raise BadInput(f"{flag} {name} needs a package that is missing: {error}") from None


def _nested(kwargs_flag: str, key: str, value: Any) -> Any:
    """A keyword argument as the class takes it: a sampler or pruner it names, made."""
    kind = NESTED.get(key)
    if kind is None or value is None:
        return value
    where = f"{kwargs_flag} {key}"
    if isinstance(value, str):
        return _make(kind, (where, f"{where}.kwargs"), value, None)
    if isinstance(value, Mapping) and set(value) <= {"name", "kwargs"} and "name" in value:
        return _make(kind, (where, f"{where}.kwargs"), value["name"], value.get("kwargs"))
    raise BadInput(
        f'{where} must be a {kind}\'s name or {{"name": NAME, "kwargs": {{...}}}}, '
        f"got {shorten(value)}"
    )
