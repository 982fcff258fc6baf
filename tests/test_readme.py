"""The README and the manual (``docs/**/*.md``) are executed: an example that does not work
fails CI.

Every ``clusterkit ...`` command (fenced or inline, and in the examples' docstrings) must name
real commands and options; those that run here without a cluster do run. Python blocks compile,
name profiles that exist and call the API with arguments its signatures take; the ones that can
run here run. YAML profiles validate against the JSON Schema and load; `helm install` lines are
rendered with `helm template`. A fenced shell line of a kind this file does not know fails, so a
new command cannot go unchecked. Every shell and Python block either runs here or carries, on
the line before it, ``<!-- not run: REASON -->`` or ``<!-- tier: TIER -->`` (the test tier that
covers what it shows).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from clusterkit.cli import app, main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: The README and every page of the manual, by path.
PAGES = {
    "README.md": README,
    **{str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))},
}
TEXT = "\n".join(PAGES.values())
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
#: ``<!-- not run: REASON -->`` or ``<!-- tier: TIER -->`` on the line before a block.
MARK = re.compile(r"<!-- (not run|tier): *(.*?) *-->\n$")


def fenced(page: str, text: str) -> list[tuple[str, str, str, tuple[str, str] | None]]:
    """(page, language, text, its mark) of each fenced block of a page."""
    found = []
    for m in FENCE.finditer(text):
        mark = MARK.search(text[: m.start()])
        found.append((page, m[1], m[2], (mark[1], mark[2]) if mark else None))
    return found


CODE = [block for page, text in PAGES.items() for block in fenced(page, text)]
BLOCKS = [(language, text) for _, language, text, _ in CODE]
PROSE = FENCE.sub("", TEXT)
BUNDLED = {p.stem for p in (ROOT / "profiles").glob("*.yaml")}
#: Profiles the manual tells the reader to save (~/.config/clusterkit/profiles/NAME.yaml).
SAVED = set(re.findall(r"~/\.config/clusterkit/profiles/([\w.-]+)\.yaml", TEXT))
#: Shell lines checked elsewhere or needing what CI does not have, and why.
NOT_RUN = {
    "kubectl ": "needs a Kubernetes cluster (the chart tier validates the manifests)",
    "helm test ": "needs a release in a cluster (the chart tier renders the test pod)",
    "terraform ": "needs providers and a cluster (the terraform tier tests the modules)",
    "python -m venv": "the GPU install needs download.pytorch.org",
    ".venv/bin/pip ": "the GPU install needs download.pytorch.org",
    "curl ": "names a live cluster's port (tests/test_web_pages.py reads /metrics this way)",
}
#: Commands that only read profiles: run for real.
READ_ONLY = {"profiles list", "profiles show", "profiles validate", "profiles render"}
READ_ONLY |= {"profiles schema"}

pytestmark = pytest.mark.unit


def shell_lines(text: str) -> list[str]:
    """Lines of a shell block, continuations joined, comments, blanks and a leading
    ``cd DIR &&`` (a folder of this checkout) dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = [line.split(" #")[0].strip() for line in joined.splitlines()]
    found = []
    for line in lines:
        where = re.match(r"cd (\S+) && ", line)
        if where:
            assert (ROOT / where[1]).is_dir(), f"`{line}`: no folder {where[1]}"
            line = line[where.end() :]
        if line and not line.startswith("#"):
            found.append(line)
    return found


def example_commands() -> list[str]:
    """`clusterkit ...` lines in the examples' docstrings."""
    found = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = shell_lines(doc)
        found += [line for line in lines if re.match(r"(\w+=\S+ )*clusterkit ", line)]
        found += [line for line in lines if re.match(r"(\w+=\S+ )+python ", line)]
    return found


def clusterkit_commands(marked: bool = True) -> list[str]:
    """Every `clusterkit ...` command in the manual (fenced and inline) and the examples;
    without ``marked``, not those of blocks marked as not run here."""
    commands = [c for c in re.findall(r"`(clusterkit(?: [^`]+)?)`", PROSE) if " " in c]
    for _, language, text, mark in CODE:
        if language in ("bash", "") and (marked or mark is None):
            commands += [
                line.removeprefix("$ ")
                for line in shell_lines(text)
                if line.removeprefix("$ ").startswith("clusterkit ")
            ]
    return [*commands, *example_commands()]


COMMANDS = clusterkit_commands()


# ------------------------------------------------------------------ clusterkit commands


def resolve(words: list[str]) -> tuple[Any, list[str], list[str]]:
    """(click command, its path, the remaining words) for a command's words."""
    command: Any = typer.main.get_command(app)
    path: list[str] = []
    while getattr(command, "commands", None) and words and not words[0].startswith("-"):
        names = words[0].split("|")  # a synopsis line: list|show NAME|...
        for name in names:
            assert name in command.commands or not name.isidentifier(), (
                f"the manual names `clusterkit {' '.join([*path, name])}`, which does not exist"
            )
        if len(names) > 1:
            return command, path, words
        command, path, words = command.commands[names[0]], [*path, names[0]], words[1:]
    return command, path, words


def options_of(command: Any) -> set[str]:
    names = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    return names | {"--help", "--install-completion", "--show-completion"}


def words_of(command_line: str) -> list[str]:
    """The words after `clusterkit`, without environment assignments or a redirection."""
    words = shlex.split(command_line.split(" > ")[0].split(" | ")[0])
    while "=" in words[0]:
        words = words[1:]
    if words[0] == "python":  # CLUSTERKIT_PROFILE=NAME python example.py: no CLI words
        return []
    assert words[0] == "clusterkit", command_line
    return words[1:]


@pytest.mark.parametrize("line", COMMANDS)
def test_command_names_real_commands_and_options(line: str) -> None:
    command, path, rest = resolve(words_of(line))
    known = options_of(command)
    for word in rest[: rest.index("--")] if "--" in rest else rest:  # then the script's own
        option = word.strip("[]").split("=")[0]
        if option.startswith("--") and option != "--":
            assert option in known, f"`{line}`: `clusterkit {' '.join(path)}` has no {option}"
    if "--profile" in rest:
        name = rest[rest.index("--profile") + 1]
        assert name in BUNDLED or name.isupper(), f"`{line}`: no bundled profile {name!r}"
    env_profile = re.search(r"CLUSTERKIT_PROFILE=(\S+)", line)
    if env_profile:
        assert env_profile[1] in BUNDLED, f"`{line}`: no bundled profile {env_profile[1]!r}"


def test_cli_synopsis_lists_every_command() -> None:
    from tests.test_cli_errors import COMMANDS as CLI_COMMANDS

    (synopsis,) = [t for lang, t in BLOCKS if not lang and t.startswith("clusterkit profiles")]
    for path in CLI_COMMANDS:
        head = " ".join(path[:1]) if path[0] != "profiles" else "profiles"
        assert re.search(rf"^clusterkit {head}\b", synopsis, re.M), f"the CLI page lacks {path}"
    profiles_line = synopsis.splitlines()[0]
    for path in CLI_COMMANDS:
        if path[0] == "profiles":
            assert re.search(rf"\b{path[1]}\b", profiles_line), f"the CLI page lacks {path}"


def test_documented_error_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manual's example of bad input prints exactly what it shows."""
    block = next(t for lang, t in BLOCKS if not lang and t.startswith("$ clusterkit"))
    command, expected = block.strip().splitlines()
    where = re.match(r"error: ([\w.-]+):(\d+): worker\.(\w+):", expected)
    assert where, expected
    file, line, field = where[1], int(where[2]), where[3]
    lines = ["backend: local", "workers: 1", "worker:", "  threads: 1"]
    lines.insert(line - 1, f"  {field}: 1")
    (tmp_path / file).write_text("\n".join(lines[: max(line, 4)]) + "\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(words_of(command.removeprefix("$ ")), capsys)
    assert (code, err.strip()) == (2, expected)


def runnable(line: str) -> bool:
    """A command that only reads profiles and names no placeholder."""
    words = words_of(line)
    placeholder = any(w.isupper() or set(w) & set("|[]") or w == "..." for w in words)
    return not placeholder and (" ".join(words[:2]) in READ_ONLY or words == ["--version"])


RUNNABLE = sorted({line for line in clusterkit_commands(marked=False) if runnable(line)})


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("line", RUNNABLE)
def test_readme_command_runs(
    line: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # from an empty directory: bundled profiles only
    words = words_of(line)
    code, out, err = run_cli(words, capsys)
    assert code == 0, f"`{line}` exited {code}: {err}"
    assert "error" not in err.lower(), err
    if "helm-values" in words:
        values = yaml.safe_load(out)
        assert values["worker"]["replicas"] >= 1
    elif "tfvars" in words:
        import hcl2

        assert hcl2.loads(out)["name"]
    elif words[-1] == "schema":
        json.loads(out)


def test_runnable_commands_were_found() -> None:
    assert len(RUNNABLE) >= 3, RUNNABLE  # the two exports and `profiles schema`


# ------------------------------------------------------------------ set-up and shell lines


def test_setup_is_two_commands_and_ci_runs_the_second() -> None:
    setup = README.split("## Set-up", 1)[1]
    (block,) = [text for language, text in FENCE.findall(setup)[:1] if language == "bash"]
    assert shell_lines(block) == ["bash scripts/demo", "bash scripts/test"]
    assert (ROOT / "scripts" / "demo").is_file() and (ROOT / "scripts" / "test").is_file()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/test" in [line.strip() for line in ci], "CI must run README command 2"
    demo = (ROOT / "scripts" / "demo").read_text()
    for script in re.findall(r"examples/\S+\.py", demo):
        assert (ROOT / script).is_file()


def test_every_shell_line_is_checked() -> None:
    for language, text in BLOCKS:
        if language != "bash":
            continue
        for line in shell_lines(text):
            known = line.startswith(("clusterkit ", "bash scripts/", "helm install "))
            assert known or line.startswith(tuple(NOT_RUN)), f"unchecked line in the manual: {line}"


@pytest.mark.chart
def test_helm_install_lines_render(tmp_path: Path) -> None:
    """Each `helm install` line of the manual, as `helm template` (same chart, same values)."""
    from tests.ops import helm

    lines = [
        line
        for language, text in BLOCKS
        if language == "bash"
        for line in shell_lines(text)
        if line.startswith("helm install ")
    ]
    assert lines
    for line in lines:
        args = shlex.split(line)[2:]
        args = [str(ROOT / a) if a.startswith("charts/") else a for a in args]
        args = [a for a in args if a != "--create-namespace"]
        helm("template", *args)


@pytest.mark.chart
def test_exported_values_install_with_the_chart(tmp_path: Path, capsys) -> None:
    """The manual's export, fed to the chart as it says: `helm install -f values.yaml`."""
    from tests.ops import helm

    code, out, _ = run_cli(["profiles", "render", "k8s-gpu", "--format", "helm-values"], capsys)
    assert code == 0
    values = tmp_path / "values.yaml"
    values.write_text(out)
    helm("template", "k8s-gpu", str(ROOT / "charts" / "clusterkit"), "-f", str(values))


# ------------------------------------------------------------------ YAML and HCL blocks


#: a YAML block of another tool's file opens with its name: `# prometheus.yml: ...`
OTHER_TOOL = re.compile(r"# [\w.-]+\.yml: ")


def other_tools_yaml() -> list[str]:
    return [text for language, text in BLOCKS if language == "yaml" and OTHER_TOOL.match(text)]


def test_other_tools_yaml_blocks_parse() -> None:
    """A block of another tool's configuration (Prometheus') is YAML, at least."""
    for text in other_tools_yaml():
        assert isinstance(yaml.safe_load(text), dict), text


def yaml_profiles() -> list[tuple[str, str]]:
    """(name, text) of each YAML block: its `# profiles/NAME.yaml` comment or a saved name."""
    found = []
    for language, text in BLOCKS:
        if language != "yaml" or OTHER_TOOL.match(text):
            continue
        named = re.match(r"# profiles/([\w.-]+)\.yaml", text)
        name = named[1] if named else next(n for n in SAVED if n in text)
        found.append((name, text))
    return found


@pytest.mark.parametrize(("name", "text"), yaml_profiles(), ids=[n for n, _ in yaml_profiles()])
def test_yaml_block_is_a_valid_profile(
    name: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jsonschema

    from clusterkit.profiles import load_profile
    from clusterkit.schema import json_schema

    data = yaml.safe_load(text)
    jsonschema.validate(data, json_schema())
    monkeypatch.setenv("SLURM_ACCOUNT", "lab")
    (tmp_path / f"{name}.yaml").write_text(text)
    if "extends" in data:  # the parent is the reader's: the smallest one of the same backend
        (tmp_path / f"{data['extends']}.yaml").write_text(f"backend: {data['backend']}\n")
    profile = load_profile(tmp_path / f"{name}.yaml")
    assert profile.backend_name == data["backend"]


def test_hcl_block_uses_the_module_variables() -> None:
    import hcl2

    variables = hcl2.loads((ROOT / "terraform/modules/dask-cluster/variables.tf").read_text())
    declared = {name.strip('"') for block in variables["variable"] for name in block}
    for language, text in BLOCKS:
        if language != "hcl":
            continue
        for module in hcl2.loads(text)["module"]:
            for body in module.values():
                unknown = {k for k in body if not k.startswith("__")} - declared - {"source"}
                assert not unknown, f"the manual's module block sets unknown variables {unknown}"


# ------------------------------------------------------------------ Python blocks


PYTHON = [text for language, text in BLOCKS if language == "python"]


def undefined_names(tree: ast.AST) -> set[str]:
    """Names a block uses but neither defines, imports nor gets from builtins."""
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - defined


def api_target(call: ast.Call, aliases: dict[str, str]) -> Any | None:
    """The clusterkit object a call names (`clusterkit.get_client`, `hpo.run`), if any."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return None
    module = aliases.get(func.value.id)
    if module is None:
        return None
    return getattr(importlib.import_module(module), func.attr)


PRELUDE = "import clusterkit\n"  # what a page's first Python block imports, for the rest


def aliases_of(tree: ast.AST) -> dict[str, str]:
    found = {"clusterkit": "clusterkit"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.asname or a.name: a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return {k: v for k, v in found.items() if v.startswith("clusterkit")}


def profiles_named(tree: ast.AST, aliases: dict[str, str]) -> list[str]:
    names = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        target = api_target(call, aliases)
        opens = getattr(target, "__name__", "") in ("get_client", "cluster")
        if opens and call.args and isinstance(call.args[0], ast.Constant):
            names.append(call.args[0].value)
    return names


@pytest.mark.parametrize("text", PYTHON, ids=[f"block{i}" for i in range(len(PYTHON))])
def test_python_block_calls_the_api_correctly(text: str) -> None:
    tree = ast.parse(text)
    aliases = aliases_of(tree)
    calls = 0
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        target = api_target(call, aliases)
        if target is None:
            continue
        calls += 1
        args = [None] * len(call.args)
        kwargs = {k.arg: None for k in call.keywords if k.arg}
        inspect.signature(target).bind(*args, **kwargs)  # TypeError: the manual is wrong
    assert calls
    for name in profiles_named(tree, aliases):
        assert name in BUNDLED | SAVED, f"the manual uses profile {name!r}, which does not exist"


RUNNABLE_PY = [
    text
    for text in PYTHON
    if not undefined_names(ast.parse(PRELUDE + text))
    and set(profiles_named(ast.parse(text), aliases_of(ast.parse(text)))) <= {"local"}
]


@pytest.mark.local
@pytest.mark.parametrize("text", RUNNABLE_PY, ids=[f"block{i}" for i in range(len(RUNNABLE_PY))])
def test_python_block_runs(text: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", PRELUDE + text]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_some_python_block_runs() -> None:
    assert RUNNABLE_PY, "no Python block of the manual can run here"


# ------------------------------------------------------------------ every block runs or says why


def code_blocks() -> list[tuple[str, str, str, tuple[str, str] | None]]:
    return [block for block in CODE if block[1] in ("bash", "sh", "shell", "console", "python")]


@pytest.mark.parametrize(
    ("page", "language", "text", "mark"),
    code_blocks(),
    ids=[f"{page}:{i}" for i, (page, *_) in enumerate(code_blocks())],
)
def test_block_runs_here_or_says_why_not(
    page: str, language: str, text: str, mark: tuple[str, str] | None
) -> None:
    """A block not run by this file names why (``not run: REASON``) or the tier that covers it."""
    from tests.conftest import TIERS

    if mark is not None:
        kind, why = mark
        assert why, f"{page}: `<!-- {kind}: -->` without a reason, before:\n{text}"
        if kind == "tier":
            assert why in TIERS, f"{page}: no test tier {why!r} (tiers: {', '.join(TIERS)})"
        return
    assert language in ("bash", "python"), f"{page}: a {language} block: use bash or python"
    if language == "python":
        assert text in RUNNABLE_PY, f"{page}: this block cannot run here; mark it:\n{text}"
    else:
        lines = shell_lines(text)
        assert lines and all(line in RUNNABLE for line in lines), (
            f"{page}: a line of this block does not run here; mark the block:\n{text}"
        )


def test_readme_links_point_at_files() -> None:
    """The README's relative links (GitHub renders them; mkdocs checks the site's own)."""
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"
