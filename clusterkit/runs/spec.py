"""A run as data: what to run (a search or a training), its options, where and on what.

:class:`RunSpec` is checked once, when it is made (one line naming the option otherwise), is
recorded as JSON in the run's record and is what the library executes
(:func:`clusterkit.runs.execution.execute`), in ``clusterkit hpo|train`` and in a detached
run's driver alike. ``RunSpec.hpo("search.py:objective", trials=60, profile="gpu-lab")``;
:func:`command_line` and :func:`from_command_line` turn a spec into the arguments of
``clusterkit hpo|train`` and back.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from typing import Annotated, Any, Literal, NoReturn

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from clusterkit.errors import BadInput, shorten

KINDS = ("hpo", "train")


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HpoOptions(_Options):
    """``clusterkit hpo``'s options, by the names of its flags (``--json``: ``as_json``);
    ``script_args``: what follows ``--``, for an Optuna script run as written."""

    kind: Literal["hpo"] = "hpo"
    trials: int | None = None
    study_name: str | None = None
    directions: tuple[str, ...] = ("minimize",)
    sampler: str | None = None
    sampler_kwargs: dict[str, Any] | None = None
    pruner: str | None = None
    pruner_kwargs: dict[str, Any] | None = None
    out: str | None = None
    storage: str | None = None
    gpus_per_trial: float = 0
    timeout: float | None = None
    trial_walltime: float | None = None
    ranks_per_trial: int = 1
    lookahead: int = 1
    mlflow: str | None = None
    checkpoint_dir: str | None = None
    max_retries: int = 2
    max_resumes: int = 10
    no_workdir: bool = False
    workdir: str | None = None
    workdir_max_size: str | None = None
    progress: bool = True
    dashboard: bool = False
    as_json: bool = False
    script_args: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _one_direction(cls, data: Any) -> Any:
        """``direction``, as specs recorded before ``directions`` (and Optuna) spell one."""
        if isinstance(data, dict) and "direction" in data:
            data = dict(data)
            direction = data.pop("direction")
            if data.get("directions") is not None:
                raise ValueError("--direction and --directions both given: give --directions")
            data["directions"] = (direction,)
        return data

    @field_validator("sampler_kwargs", "pruner_kwargs", mode="before")
    @classmethod
    def _json(cls, value: Any, info: ValidationInfo) -> Any:
        """Keyword arguments as the command line gives them: a JSON object's text."""
        flag = f"--{str(info.field_name).replace('_', '-')}"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise ValueError(f"{flag} is not JSON: {error}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{flag} must be a JSON object, got {shorten(value)}")
        return value

    @model_validator(mode="after")
    def _numbers(self) -> HpoOptions:
        for option in ("lookahead", "max_retries", "max_resumes"):
            if (value := getattr(self, option)) < 0:
                raise ValueError(f"--{option.replace('_', '-')} must be 0 or more, got {value}")
        if self.ranks_per_trial < 1:
            raise ValueError(f"--ranks-per-trial must be at least 1, got {self.ranks_per_trial}")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"--trials must be at least 1, got {self.trials}")
        if not self.directions:
            raise ValueError("--directions takes one or more of minimize, maximize")
        flag = "--direction" if len(self.directions) == 1 else "--directions"
        for direction in self.directions:
            if direction not in ("minimize", "maximize"):
                raise ValueError(f"{flag} must be minimize or maximize, got {direction!r}")
        for knob in ("sampler", "pruner"):
            if getattr(self, f"{knob}_kwargs") and getattr(self, knob) is None:
                raise ValueError(f"--{knob}-kwargs needs --{knob} NAME")
        if self.gpus_per_trial < 0:
            raise ValueError(f"--gpus-per-trial must be 0 or more, got {self.gpus_per_trial:g}")
        for option in ("timeout", "trial_walltime"):
            value = getattr(self, option)
            if value is not None and value <= 0:
                raise ValueError(f"--{option.replace('_', '-')} must be positive, got {value:g}")
        return self


class TrainOptions(_Options):
    """``clusterkit train``'s options; ``script_args``: what follows ``--``."""

    kind: Literal["train"] = "train"
    max_restarts: int = 0
    checkpoint_dir: str | None = None
    tracebacks: bool = False
    world_size: int | None = None
    timeout: float | None = None
    workdir_max_size: str | None = None
    no_workdir: bool = False
    workdir: str | None = None
    script_args: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _numbers(self) -> TrainOptions:
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, got {self.world_size}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        return self


Options = Annotated[HpoOptions | TrainOptions, Field(discriminator="kind")]

#: What an Optuna script decides itself (its ``create_study`` and ``study.optimize``): no flag
#: of ``clusterkit hpo SCRIPT.py``.
SCRIPT_OWN = (
    *("trials", "study_name", "storage", "directions", "sampler", "sampler_kwargs", "pruner"),
    *("pruner_kwargs", "timeout", "mlflow", "dashboard", "as_json"),
)


def is_script(target: str) -> bool:
    """A search's target is a whole Optuna script (``SCRIPT.py``), not ``FILE.py:FUNC``."""
    return ":" not in target


class RunSpec(BaseModel):
    """One run: ``target`` (``FILE.py:FUNC`` for a search, ``FILE.py[:FUNC]`` for a training)
    with its options, the profile (or cluster from `up`; None: ``$CLUSTERKIT_PROFILE`` or
    local) and the directory relative paths are resolved in."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    options: Options
    profile: str | None = None
    cwd: str = Field(default_factory=os.getcwd)

    @property
    def kind(self) -> str:
        return self.options.kind

    @model_validator(mode="after")
    def _target(self) -> RunSpec:
        """A search's options fit its target: an objective needs ``--trials`` and takes no
        script arguments; a script decides its study and trials itself."""
        options = self.options
        if not isinstance(options, HpoOptions):
            return self
        if not is_script(self.target):
            if options.trials is None:
                raise ValueError("--trials N is required for FILE.py:FUNC")
            if options.script_args:
                raise ValueError("arguments after -- are for a script: SCRIPT.py, no :FUNC")
            return self
        fields = HpoOptions.model_fields
        for name in SCRIPT_OWN:
            if getattr(options, name) != fields[name].default:
                flag = "--direction(s)" if name == "directions" else _flags(name)[0]
                raise ValueError(
                    f"{flag} is the script's own (its create_study and study.optimize): "
                    f"not for {self.target} (an objective: FILE.py:FUNC)"
                )
        return self

    @classmethod
    def hpo(cls, target: str, *, profile: str | None = None, **options: Any) -> RunSpec:
        """A search; ``options`` as :class:`HpoOptions` names them (BadInput when wrong)."""
        return load({"target": target, "profile": profile, "options": {"kind": "hpo", **options}})

    @classmethod
    def train(
        cls, target: str, *, profile: str | None = None, script_args: Any = (), **options: Any
    ) -> RunSpec:
        """A training; ``options`` as :class:`TrainOptions` names them (BadInput when wrong)."""
        options.update(kind="train", script_args=tuple(script_args))
        return load({"target": target, "profile": profile, "options": options})

    def replaced(self, *, profile: Any = ..., target: str | None = None, **options: Any) -> RunSpec:
        """This spec with some fields changed (checked again)."""
        data = self.model_dump()
        if "direction" in options:  # as RunSpec.hpo takes it
            data["options"].pop("directions")
        data["options"].update(options)
        if target is not None:
            data["target"] = target
        if profile is not ...:
            data["profile"] = profile
        return load(data)


def load(data: dict[str, Any]) -> RunSpec:
    """A spec from its JSON form (as recorded); BadInput naming the first wrong field."""
    options = data.get("options")
    kind = options.get("kind") if isinstance(options, dict) else None
    if kind not in KINDS:
        raise BadInput(f"run kind must be hpo or train, got {shorten(kind)}")
    try:
        return RunSpec.model_validate(data)
    except ValidationError as error:
        raise spec_error(error) from None


def spec_error(error: ValidationError) -> BadInput:
    """The first problem of a spec, in one line (a check's own message as it is)."""
    first = error.errors(include_url=False)[0]
    cause = (first.get("ctx") or {}).get("error")
    if first["type"] == "value_error" and cause is not None:
        return BadInput(str(cause))
    where = ".".join(str(part) for part in first["loc"] if part not in KINDS)
    got = "" if first["type"] == "missing" else f", got {shorten(first.get('input'))}"
    return BadInput(f"run spec: {where}: {first['msg']}{got}")


# ------------------------------------------------------------------ the command line

#: Flags whose name is not ``--`` and the field's name with dashes.
FLAGS = {
    "trials": ("--trials", "-n"),
    "world_size": ("--world-size", "-n"),
    "profile": ("--profile", "-p"),
    "as_json": ("--json",),
}
#: The order ``clusterkit hpo|train --detach`` recorded their arguments in, kept.
ORDER = {
    "hpo": [
        *("trials", "study_name", "directions", "sampler", "sampler_kwargs", "pruner"),
        *("pruner_kwargs", "out", "storage", "profile", "gpus_per_trial"),
        *("timeout", "trial_walltime", "ranks_per_trial", "lookahead", "mlflow"),
        *("checkpoint_dir", "no_workdir", "workdir", "workdir_max_size"),
        *("progress", "dashboard", "as_json", "max_retries", "max_resumes"),
    ],
    "train": [
        *("max_restarts", "checkpoint_dir", "tracebacks", "profile", "world_size", "timeout"),
        *("workdir_max_size", "no_workdir", "workdir"),
    ],
}
#: Options given on the command line even at their default.
ALWAYS = {"trials", "directions", "max_restarts"}
#: The flag of a detached run's driver restarts (train's ``--max-restarts`` is the ranks').
DETACH_FLAGS = {"hpo": "--max-restarts", "train": "--driver-restarts"}


def _flags(name: str) -> tuple[str, ...]:
    return FLAGS.get(name, (f"--{name.replace('_', '-')}",))


def command_line(spec: RunSpec) -> list[str]:
    """The arguments of ``clusterkit KIND`` that run ``spec`` (in ``spec.cwd``)."""
    argv, options = [spec.target], spec.options
    fields = type(options).model_fields
    for name in ORDER[spec.kind]:
        if name == "profile":
            value, default = spec.profile, None
        else:
            value, default = getattr(options, name), fields[name].default
        always = name in ALWAYS and not (spec.kind == "hpo" and is_script(spec.target))
        if value is None or (value == default and not always):
            continue
        if isinstance(value, bool):
            argv.append(_flags(name)[0] if value else f"--no-{name}")
        elif name == "directions":  # one as it always was, several as Optuna's CLI takes them
            argv += ["--direction", *value] if len(value) == 1 else ["--directions", *value]
        elif isinstance(value, dict):
            argv += [_flags(name)[0], json.dumps(value)]
        else:
            argv += [_flags(name)[0], str(value)]
    if options.script_args:
        argv += ["--", *options.script_args]
    return argv


def from_command_line(
    kind: str, args: list[str], *, cwd: str | None = None
) -> tuple[RunSpec, dict[str, Any]]:
    """The spec that ``clusterkit KIND ARGS`` runs, and what detaching it takes beside
    (``max_restarts``: the detach flag's value or None; ``batch``); BadInput when wrong."""
    if kind not in KINDS:
        raise BadInput(f"kind must be hpo or train, got {shorten(kind)}")
    split = args.index("--") if "--" in args else len(args)
    parsed = vars(_parser(kind).parse_intermixed_args(args[:split]))
    extra = [*parsed.pop("script_args", []), *args[split + 1 :]]
    detach = {"max_restarts": parsed.pop("detach_restarts"), "batch": parsed.pop("batch")}
    parsed.pop("detach")
    if kind == "hpo":
        from clusterkit.runners.hpo.knobs import check_directions

        parsed["directions"] = check_directions(parsed.pop("direction"), parsed["directions"])
    options = {name: value for name, value in parsed.items() if value is not None}
    target, profile = options.pop("target"), options.pop("profile", None)
    options["script_args"] = tuple(extra)
    options["kind"] = kind
    data = {"target": target, "profile": profile, "options": options, "cwd": cwd or os.getcwd()}
    return load(data), detach


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, its errors raised as BadInput (one line) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{self.prog}: {message}")


def _parser(kind: str) -> argparse.ArgumentParser:
    """``clusterkit KIND``'s arguments, from the fields of its options."""
    parser = _ArgumentParser(prog=f"clusterkit {kind}", add_help=False, allow_abbrev=False)
    parser.add_argument("target")
    parser.add_argument("script_args", nargs="*")
    model = HpoOptions if kind == "hpo" else TrainOptions
    for name, field in model.model_fields.items():
        if name in ("kind", "script_args"):
            continue
        if field.default is True:  # --progress/--no-progress
            parser.add_argument(*_flags(name), dest=name, action=argparse.BooleanOptionalAction)
        elif field.annotation is bool:
            parser.add_argument(*_flags(name), dest=name, action="store_const", const=True)
        elif name == "directions":  # nargs, as Optuna's CLI; --direction: at most once
            parser.add_argument("--directions", dest=name, nargs="+", action="extend")
            parser.add_argument("--direction", dest="direction", action="append")
        elif name.endswith("_kwargs"):  # JSON text, read by the field
            parser.add_argument(*_flags(name), dest=name)
        else:
            kinds = typing.get_args(field.annotation) or (field.annotation,)
            scalar: Any = next(t for t in kinds if t is not type(None))
            parser.add_argument(*_flags(name), dest=name, type=scalar)
    parser.add_argument(*_flags("profile"), dest="profile")
    parser.add_argument("--detach", "-d", action="store_true")
    parser.add_argument("--batch", action="store_true")
    parser.add_argument(DETACH_FLAGS[kind], dest="detach_restarts", type=int)
    return parser
