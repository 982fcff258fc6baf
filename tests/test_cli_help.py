"""Every command's ``--help`` reads as prose: flags without a value type, no sentence broken.

The commands are read from the CLI itself, so a new command is covered without editing this file.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer

from clusterkit.cli import app, main

pytestmark = pytest.mark.unit

#: How a line of help text may end on a terminal wide enough never to wrap it: a sentence's end,
#: an option's "[default: 3]"/"[required]", or a lead-in to what follows.
ENDS = (".", "]", ")", ":", "!", "?")


def every_command(command: Any = None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The root, each group and each command, as argv paths."""
    command = command or typer.main.get_command(app)
    found = [path]
    for name, sub in (getattr(command, "commands", None) or {}).items():
        found += every_command(sub, (*path, name))
    return found


def help_of(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        main([*path, "--help"])  # click returns after the help (not standalone)
    except SystemExit as exited:
        assert not exited.code, path
    out, err = capsys.readouterr()
    assert "Usage" in out and not err, (path, err)
    return out


def prose_lines(text: str) -> list[str]:
    """The help's own lines and each panel row's last cell, without the box drawing."""
    found = []
    for line in text.splitlines():
        inner = line.strip().strip("│").strip()
        if not inner or inner[0] in "╭╰" or inner.startswith("Usage:"):
            continue
        found.append(re.split(r"\s{2,}", inner)[-1])  # a panel row: name, type, help
    return found


@pytest.mark.parametrize("path", every_command(), ids=lambda p: " ".join(p) or "clusterkit")
def test_help_shows_flags_untyped_and_no_sentence_broken(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps nothing: every break is the source's
    text = help_of(path, capsys)
    assert "<bool>" not in text, text
    broken = [line for line in prose_lines(text) if not line.endswith(ENDS)]
    assert not broken, f"clusterkit {' '.join(path)} --help breaks mid-sentence: {broken}"


def test_every_command_is_walked() -> None:
    names = {" ".join(p) for p in every_command()}
    assert {"", "up", "dashboard", "hpo", "train", "profiles", "profiles list", "runs"} <= names
