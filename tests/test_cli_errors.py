"""Usage errors of every command: one ``error: ...`` line, exit 2, no traceback, nothing started.

The commands are read from the CLI itself, so a new command is covered without editing this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from clusterkit.cli import app, main

pytestmark = pytest.mark.unit


def leaf_commands(command: Any = None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    command = command or typer.main.get_command(app)
    subcommands = getattr(command, "commands", None)
    if not subcommands:
        yield path
        return
    for name, sub in subcommands.items():
        yield from leaf_commands(sub, (*path, name))


def groups() -> list[tuple[tuple[str, ...], list[str]]]:
    """(path, its subcommand names) for the root and each group."""
    found = []

    def visit(command: Any, path: tuple[str, ...]) -> None:
        subcommands = getattr(command, "commands", None)
        if subcommands:
            found.append((path, sorted(subcommands)))
            for name, sub in subcommands.items():
                visit(sub, (*path, name))

    visit(typer.main.get_command(app), ())
    return found


def command_of(path: tuple[str, ...]) -> Any:
    command: Any = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


COMMANDS = list(leaf_commands())


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], state: Path) -> str:
    """Run the CLI in-process; it must exit 2 with one error line and leave no state behind."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, (argv, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    assert "Traceback" not in err and not out
    assert not any(state.iterdir()), f"{argv} wrote state: {list(state.iterdir())}"
    return lines[0]


def test_every_command_is_covered() -> None:
    names = {" ".join(p) for p in COMMANDS}
    assert {"up", "down", "status", "scale", "hpo", "train", "profiles list"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_unknown_option(path: tuple[str, ...], capsys: pytest.CaptureFixture[str], isolated_state):
    line = usage_error([*path, "--no-such-flag"], capsys, isolated_state)
    assert "No such option: --no-such-flag" in line
    assert f"(see 'clusterkit {' '.join(path)} --help')" in line


def long_options(path: tuple[str, ...]) -> list[str]:
    """The command's long options long enough that dropping a letter leaves a clear typo."""
    return [
        opt
        for param in command_of(path).params
        for opt in param.opts
        if opt.startswith("--") and len(opt) > 5 and opt != "--help"
    ]


@pytest.mark.parametrize("path", [p for p in COMMANDS if long_options(p)], ids=" ".join)
def test_misspelled_option_gets_a_suggestion(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str], isolated_state
) -> None:
    option = long_options(path)[0]
    typo = option[:3] + option[4:]  # one letter dropped: --nme for --name
    line = usage_error([*path, typo], capsys, isolated_state)
    assert f"No such option: {typo}" in line
    assert option in line, line  # click's "Did you mean" / "Possible options"


@pytest.mark.parametrize(
    "path", [p for p in COMMANDS if any(q.required for q in command_of(p).params)], ids=" ".join
)
def test_missing_argument(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str], isolated_state
):
    line = usage_error(list(path), capsys, isolated_state)
    assert "Missing" in line


@pytest.mark.parametrize("group", groups(), ids=lambda g: " ".join(g[0]) or "clusterkit")
def test_unknown_command_suggests_the_nearest(
    group: tuple[tuple[str, ...], list[str]], capsys: pytest.CaptureFixture[str], isolated_state
) -> None:
    path, names = group
    line = usage_error([*path, "no-such-command"], capsys, isolated_state)
    assert "No such command 'no-such-command'" in line
    typo = names[0][:-1] + "x"  # one letter off a real command
    line = usage_error([*path, typo], capsys, isolated_state)
    assert f"Did you mean '{names[0]}'" in line, line


def test_bad_value_is_a_usage_error(capsys: pytest.CaptureFixture[str], isolated_state) -> None:
    line = usage_error(["scale", "somecluster", "many"], capsys, isolated_state)
    assert "Invalid value for 'workers'" in line


@pytest.mark.parametrize(
    "argv",
    [["bogus"], ["status"], ["up", "--nme", "x"], ["profiles", "shw", "local"]],
    ids=" ".join,
)
def test_console_script_prints_one_line(argv: list[str], tmp_path: Path) -> None:
    """The installed entry point, as a user runs it (the issue's own examples)."""
    script = Path(sys.executable).with_name("clusterkit")
    env = {k: v for k, v in os.environ.items() if k != "CLUSTERKIT_DEBUG"}
    done = subprocess.run(
        [str(script), *argv], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert done.returncode == 2, done
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv", [[], ["profiles"]], ids=lambda a: " ".join(a) or "clusterkit")
def test_a_group_alone_prints_its_help(argv: list[str], capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 0 and "Usage" in out and not err


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("gpu-slurm", "slurm-gpu"),
        ("lcoal", "local"),
        ("k8s_gpu", "k8s-gpu"),
        ("slurmgpu", "slurm-gpu"),
    ],
)
def test_unknown_profile_suggests_the_closest(
    typed: str, meant: str, capsys: pytest.CaptureFixture[str], isolated_state
) -> None:
    for argv in (["profiles", "show", typed], ["up", typed], ["profiles", "render", typed]):
        line = usage_error(argv, capsys, isolated_state)
        assert line == f"error: no profile named '{typed}' (did you mean '{meant}'?)", line


def test_unknown_profile_found_on_the_search_path(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    isolated_state,
) -> None:
    (tmp_path / "team-a100.yaml").write_text("backend: local\nworkers: 1\n")
    monkeypatch.setenv("CLUSTERKIT_PROFILES", str(tmp_path))
    line = usage_error(["profiles", "show", "team-a10"], capsys, isolated_state)
    assert "did you mean 'team-a100'?" in line
