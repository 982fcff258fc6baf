"""MkDocs hook: the reference pages are generated from the code, never kept by hand.

``reference/cli.md`` walks the click command tree of ``clusterkit.cli``'s typer app;
``reference/profiles.md`` walks the pydantic models of every backend (``clusterkit.schema.MODELS``)
and ``clusterkit.siteconfig``'s mapping of fields to Dask config keys. A CLI option or argument
without help text, or a profile field without a description, fails the build: a new one cannot
ship without its line.
"""

from __future__ import annotations

import typing
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

CLI_PAGE = "reference/cli.md"
PROFILE_PAGE = "reference/profiles.md"


def on_files(files: Files, config: Any) -> Files:
    for path, render in ((CLI_PAGE, cli_page), (PROFILE_PAGE, profile_page)):
        files.append(File.generated(config, path, content=render()))
    return files


# ------------------------------------------------------------------ the CLI


def cli_page() -> str:
    import typer

    from clusterkit.cli import app

    root = typer.main.get_command(app)
    missing: list[str] = []
    out = [
        "# CLI",
        "",
        "Generated from the `clusterkit` command itself (its typer app) at each build: every",
        "command, argument and option with its help. `clusterkit COMMAND --help` prints the same.",
        "",
    ]
    for path, command in walk(root, ()):
        out += command_section(path, command, missing)
    if missing:
        raise PluginError("CLI parameters without help text: " + ", ".join(missing))
    return "\n".join(out) + "\n"


def walk(command: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    found = [(path, command)]
    for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
        if not getattr(sub, "hidden", False):
            found += walk(sub, (*path, name))
    return found


def command_section(path: tuple[str, ...], command: Any, missing: list[str]) -> list[str]:
    name = " ".join(("clusterkit", *path))
    lines = [f"## `{name}`", "", f"`{usage(name, command)}`", ""]
    text = (command.help or "").strip()
    if path and not text:
        missing.append(f"`{name}` (the command)")
    lines += [text.replace("\b\n", ""), ""] if text else []
    rows = []
    for param in command.params:
        if getattr(param, "hidden", False) or param.name in (
            "install_completion",
            "show_completion",
        ):
            continue
        names = ", ".join(f"`{n}`" for n in (*param.opts, *param.secondary_opts))
        if param.param_type_name == "argument":
            names = f"`{argument_name(param)}`"
        help_text = " ".join((getattr(param, "help", None) or "").split())
        if not help_text:
            missing.append(f"`{name}` {names}")
        default = param.default if not callable(param.default) else None
        shown = "" if default in (None, False, (), []) else f"`{default}`"
        kind = "argument" if param.param_type_name == "argument" else "option"
        required = " (required)" if param.required else ""
        rows.append(f"| {escape(names)} | {kind}{required} | {shown} | {escape(help_text)} |")
    if rows:
        lines += ["| name | kind | default | help |", "| --- | --- | --- | --- |", *rows, ""]
    return lines


def argument_name(param: Any) -> str:
    return param.metavar or (param.name or "").upper()


def usage(name: str, command: Any) -> str:
    """``clusterkit up [OPTIONS] NAME``: the command's synopsis, arguments by their metavar."""
    words = [name, "[OPTIONS]"]
    for param in command.params:
        if param.param_type_name == "argument":
            word = argument_name(param) + ("..." if param.nargs == -1 else "")
            words.append(word if param.required else f"[{word}]")
    if getattr(command, "commands", None):
        words.append("COMMAND [ARGS]...")
    return " ".join(words)


def escape(text: str) -> str:
    """Text for a table cell: outside `code`, a pipe would split the cell and <x> be a tag."""
    parts = text.split("`")
    outside = (p.replace("|", "\\|").replace("<", "&lt;") for p in parts[::2])
    parts[::2] = list(outside)
    return "`".join(parts)


# ------------------------------------------------------------------ the profile fields


def profile_page() -> str:
    from clusterkit import siteconfig
    from clusterkit.schema import MODELS

    fields: dict[str, dict[tuple[str, str, str], set[str]]] = {}
    missing: set[str] = set()
    for backend, model in MODELS.items():
        for path, row in model_rows(model, ""):
            if not row[2]:
                missing.add(f"{model.__name__}.{path}")
            fields.setdefault(path, {}).setdefault(row, set()).add(backend)
    if missing:
        raise PluginError("profile fields without a description: " + ", ".join(sorted(missing)))
    keys = config_keys(siteconfig)
    out = [
        "# Profile fields",
        "",
        "Generated from the pydantic models of `clusterkit.schema` at each build: every field a",
        "profile may set, its type and default, the backends that read it, and for SLURM, PBS,",
        "Grid Engine and HTCondor the site's Dask config key that fills it when the profile",
        "leaves it unset (`clusterkit profiles render NAME --explain` shows where each value came",
        "from). A field with two rows means two things on different backends. Every profile may",
        "also name `extends`: another profile it builds on (this file wins). A `Size` is bytes or",
        "a string such as `24GiB`, a `Duration` seconds or a string such as `90s` or `5m`, a",
        "`Walltime` `HH:MM:SS` (`clusterkit/units.py`).",
        "",
        "| field | type | default | backends | Dask config key | what it is |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    order = list(MODELS)
    backends = " \\| ".join(f"`{name}`" for name in order)  # one row, not one per backend
    out.append(f"| `backend` | one of {backends} | required | all | | the system that runs it |")
    fields.pop("backend")
    for path in sorted(fields):
        for (type_, default, description), backends in fields[path].items():
            names = sorted(backends, key=order.index)
            shown = backend_list(names, order)
            key = "<br>".join(f"`{k}`" for b in names for k in keys.get((b, path), []))
            out.append(
                f"| `{path}` | {escape(type_)} | {default} | {shown} | {key} "
                f"| {escape(description)} |"
            )
    return "\n".join(out) + "\n"


def backend_list(names: list[str], order: list[str]) -> str:
    """``all``, ``all but address``, or the names."""
    left_out = [name for name in order if name not in names]
    if not left_out:
        return "all"
    return f"all but {', '.join(left_out)}" if len(left_out) <= 2 else ", ".join(names)


def config_keys(siteconfig: Any) -> dict[tuple[str, str], list[str]]:
    """``(backend, field) -> [Dask config key]`` from ``siteconfig``'s own mapping."""
    keys: dict[tuple[str, str], list[str]] = {}
    for backend, section in siteconfig.SECTIONS.items():
        extra = {f: o for (b, f), o in siteconfig.EXTRA_FIELDS.items() if b == backend}
        for field, option in {**siteconfig.FIELDS, **extra}.items():
            keys.setdefault((backend, field), []).append(f"{section}.{option}")
    return keys


def model_rows(model: Any, prefix: str) -> list[tuple[str, tuple[str, str, str]]]:
    """``(dotted path, (type, default, description))`` of a model's fields, nested ones too."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    rows = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        if info.default_factory is not None:
            default = f"`{info.default_factory()!r}`"  # type: ignore[call-arg]
        elif info.default is PydanticUndefined:
            default = "required"
        elif isinstance(info.default, BaseModel):
            default = "its fields'"  # listed below it, with their own defaults
        else:
            default = f"`{info.default!r}`"
        description = " ".join((info.description or "").split())
        alias = unit_alias(info)
        if alias == "Size" and isinstance(info.default, int):
            default = f"`{info.default}` ({info.default / 2**30:g} GiB)"
        type_ = f"`{alias}`" if alias else type_name(info.annotation)
        rows.append((path, (type_, default, description)))
        for sub in nested_models(info.annotation):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                rows += model_rows(sub, f"{path}.")
    return rows


def unit_alias(info: Any) -> str | None:
    """``Size``, ``Duration`` or ``Walltime`` where pydantic stripped the alias to its base
    type and kept its validators in the field's metadata (``memory: Size`` reads ``int``)."""
    from clusterkit import units

    for alias in ("Size", "Duration", "Walltime"):
        extra = typing.get_args(getattr(units, alias))[1:]
        if extra and all(item in info.metadata for item in extra):
            return alias
    return None


def nested_models(annotation: Any) -> list[Any]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in nested_models(arg)]


def type_name(annotation: Any) -> str:
    return f"`{type_text(annotation)}`"


def type_text(annotation: Any) -> str:
    """``Size | None``, ``list[str]``, ``'gres' | 'gpus-per-task'``: as a profile reads it."""
    from clusterkit import units

    for alias in ("Size", "Duration", "Walltime", "Port"):  # sizes, durations: see units.py
        if annotation == getattr(units, alias):
            return alias
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        return " | ".join(type_text(a) for a in args)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_text(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", repr(annotation))
