"""YAML read as plain data with the file and line of every key path.

Safe by construction: the text is composed into nodes and converted here, so tags other than
the standard scalar ones are refused (never constructed), aliases are bounded, duplicate keys
and merge keys are errors, and every error names file, line and field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from clusterkit.errors import ProfileError, cut, printable, shorten

MAX_NODES = 10_000  # alias-expansion bombs stop here
MAX_BYTES = 1 << 20
MAX_DEPTH = 32  # nesting of lists and mappings; a profile needs four or five

_STANDARD_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}

Path_ = tuple[str | int, ...]


def display(path: Path) -> str:
    """A path as shown in messages: relative to the current directory when below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass
class Located:
    """A mapping read from one file, with the line of every key path."""

    data: dict[str, Any]
    lines: dict[Path_, tuple[str, int]]  # key path -> (file, line)
    filled: dict[str, str] = field(default_factory=dict)  # field -> Dask config key it came from


def _read_text(path: Path, shown: str) -> str:
    raw = path.read_bytes()
    if len(raw) > MAX_BYTES:
        raise ProfileError(f"file is {len(raw)} bytes; a profile is at most 1 MiB", file=shown)
    if b"\0" in raw:
        line = raw[: raw.index(b"\0")].count(b"\n") + 1
        raise ProfileError("binary data (NUL byte): not a YAML text file", file=shown, line=line)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ProfileError(
            f"not UTF-8 text (byte 0x{raw[error.start]:02x})",
            file=shown,
            line=line,
            hint="save the file as UTF-8",
        ) from None


class _Reader:
    """Turns composed YAML nodes into plain data, refusing anything unsafe."""

    def __init__(self, shown: str) -> None:
        self.shown = shown
        self.nodes = 0
        self.lines: dict[Path_, tuple[str, int]] = {}

    def fail(
        self, node: yaml.Node, message: str, path: Path_ = (), hint: str | None = None
    ) -> None:
        raise ProfileError(
            message,
            file=self.shown,
            line=node.start_mark.line + 1,
            field=dotted(path) or None,
            hint=hint,
        )

    def convert(self, node: yaml.Node, path: Path_) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self.fail(node, f"document expands to more than {MAX_NODES} nodes (alias bomb?)")
        if len(path) > MAX_DEPTH:
            self.fail(node, f"nested deeper than {MAX_DEPTH} levels", path[:1])
        if node.tag not in _STANDARD_TAGS:
            if node.tag.startswith("tag:yaml.org,2002:python/") or node.tag.startswith("!"):
                self.fail(
                    node,
                    f"YAML tag {shorten(node.tag)} is not allowed",
                    path,
                    hint="profiles are plain data; remove the tag",
                )
            self.fail(node, f"unsupported YAML type {shorten(node.tag)}", path)
        self.lines.setdefault(path, (self.shown, node.start_mark.line + 1))
        if isinstance(node, yaml.MappingNode):
            result: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    self.fail(key_node, "keys must be plain strings", path)
                key = str(yaml.SafeLoader.construct_scalar(_LOADER, key_node))  # type: ignore[arg-type]
                if key == "<<":
                    self.fail(
                        key_node,
                        "merge keys ('<<') are not supported",
                        path,
                        hint="use `extends: other-profile` instead",
                    )
                if key in result:
                    self.fail(key_node, f"duplicate key '{cut(printable(key))}'", (*path, key))
                self.lines[(*path, key)] = (self.shown, key_node.start_mark.line + 1)
                result[key] = self.convert(value_node, (*path, key))
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.convert(item, (*path, i)) for i, item in enumerate(node.value)]
        try:
            return _LOADER.construct_object(node)
        except ValueError:  # an integer of more than 4300 digits
            self.fail(node, f"number {cut(str(node.value))} is too large", path)


_LOADER = yaml.SafeLoader("")


class _TooDeep(Exception):
    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


class _DepthLimited(yaml.SafeLoader):
    """Stops composing below ``MAX_DEPTH``: PyYAML recurses, and is quadratic in flow depth."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self._depth >= MAX_DEPTH:
            raise _TooDeep(self.peek_event().start_mark.line + 1)
        self._depth += 1
        try:
            return super().compose_node(parent, index)  # type: ignore[no-untyped-call]
        finally:
            self._depth -= 1


def _yaml_problem(error: yaml.YAMLError, text: str) -> tuple[int | None, str, str | None]:
    if isinstance(error, yaml.reader.ReaderError):  # a control character; no problem_mark
        at = text[: error.position].count("\n") + 1
        return at, f"YAML syntax: control character #x{error.character:04x} is not allowed", None
    mark = getattr(error, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(error, "problem", None) or str(error)
    if "'\\t'" in problem or "\\t" in problem:
        return line, "tab character in indentation", "indent with spaces"
    context = getattr(error, "context", None)
    text = f"YAML syntax: {problem}" + (f" ({context})" if context else "")
    return line, text, None


def _top_level_key(text: str, line: int) -> str | None:
    """The top-level key written at or above ``line`` (block style), to name a field."""
    for row in reversed(text.splitlines()[:line]):
        match = re.match(r"([A-Za-z_][\w.-]*)\s*:", row)
        if match:
            return match.group(1)
    return None


def read_file(path: Path) -> Located:
    """Parse one profile file into data and a line map (no extends, no interpolation)."""
    shown = display(path)
    text = _read_text(path, shown)
    if not text.strip() or all(
        not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()
    ):
        raise ProfileError(
            "empty profile",
            file=shown,
            line=1,
            hint="a profile is a mapping with at least `backend:`",
        )
    try:
        nodes = list(yaml.compose_all(text, Loader=_DepthLimited))
    except yaml.YAMLError as error:
        line, message, hint = _yaml_problem(error, text)
        raise ProfileError(message, file=shown, line=line, hint=hint) from None
    except _TooDeep as error:
        raise ProfileError(
            f"nested deeper than {MAX_DEPTH} levels",
            file=shown,
            line=error.line,
            field=_top_level_key(text, error.line),
        ) from None
    nodes = [n for n in nodes if n is not None]
    if len(nodes) != 1:
        raise ProfileError(
            "a profile is one YAML document",
            file=shown,
            line=nodes[1].start_mark.line + 1 if len(nodes) > 1 else 1,
        )
    root = nodes[0]
    if not isinstance(root, yaml.MappingNode):
        kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
        raise ProfileError(
            f"the top level must be a mapping, got {kind}",
            file=shown,
            line=root.start_mark.line + 1,
        )
    reader = _Reader(shown)
    data = reader.convert(root, ())
    return Located(data, reader.lines)
