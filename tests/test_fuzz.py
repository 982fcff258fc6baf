"""Bad input, fuzzed: mutated profiles and CLI arguments end in a clean load or one short line.

Property-based (hypothesis), derandomized so CI replays the same cases: every bundled profile
mutated (keys dropped, values swapped for other YAML types, empty strings, huge numbers, 5,000
character strings, deep nesting, unicode, unknown keys, ``extends`` and ``${VAR}``), and its
text truncated or salted with raw bytes. The only outcomes allowed: a profile, or a ``BadInput``
whose ``one_line()`` is one line of at most 300 characters naming the file and line, exit 2.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterkit.errors import EXIT_BAD_INPUT, BadInput, ProfileError
from clusterkit.profiles import load_profile

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = {p.stem: p.read_text() for p in sorted((ROOT / "profiles").glob("*.yaml"))}
PARSED = {name: yaml.safe_load(text) for name, text in BUNDLED.items()}
MAX_LINE = 300
LONG = "x" * 5000

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ------------------------------------------------------------------ the property


def verdict(path: Path) -> str | None:
    """None for a clean load or a well-formed error; otherwise what is wrong (with the cause)."""
    try:
        load_profile(path)
    except BadInput as error:
        line = error.one_line()
        if error.exit_code != EXIT_BAD_INPUT:
            return f"exit code {error.exit_code}: {line[:200]!r}"
        if len(line.splitlines()) != 1 or len(line) > MAX_LINE:
            return f"not one short line ({len(line)} chars): {line[:200]!r}"
        if isinstance(error, ProfileError) and not (error.file and error.line):
            return f"no file and line: {line[:200]!r}"
        return None
    except Exception as error:  # anything else is a traceback for the user
        return f"{type(error).__name__}: {str(error)[:200]!r}"
    return None


@pytest.fixture(scope="module")
def fuzz_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ck-fuzz-") as tmp:
        yield Path(tmp)


def check_text(directory: Path, text: str | bytes) -> None:
    path = directory / "fuzz.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    problem = verdict(path)
    assert problem is None, problem


# ------------------------------------------------------------------ strategies


def nest(depth: int) -> Any:
    value: Any = "deep"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


SPECIAL = [
    "", " ", LONG, "0", "-1", "nan", ".nan", "inf", "-inf", "1e400", "1e400s", "nans", "infGB",
    "10m", "90s", "1h", "24GiB", "0GiB", "-5s", "04:00:00", "99999999999999-00:00:00", "auto",
    "tcp", "ucx", "local", "slurm", "${CLUSTERKIT_FUZZ_UNSET}", "${" + "A" * 5000 + "}", "${",
    "$$", LONG + ".yaml", "../" * 2000 + "x.yaml", "no-such-profile", "fuzz", "a\nb", "\t",
    "é\u2028ü\U0001f600", "\x85", "tcp://127.0.0.1:8786", "select=1",
]  # fmt: skip
NUMBERS = [0, -1, 1, 10**30, -(10**30), 2**63, 10**400, float("nan"), float("inf"), -1e308]
SCALARS = st.one_of(
    st.sampled_from(SPECIAL),
    st.sampled_from(NUMBERS),
    st.text(max_size=20),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
)
VALUES = st.one_of(
    st.recursive(
        SCALARS,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=6,
    ),
    st.integers(20, 120).map(nest),
)
FIELDS = sorted(
    {k for data in PARSED.values() for k in data}
    | {"extends", "lifetime", "lifetime_stagger", "idle_timeout", "memory", "threads", "gpus"}
)
NEW_KEYS = st.one_of(st.sampled_from([*FIELDS, LONG, "", "<<"]), st.text(max_size=12))


def paths_of(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, (dict, list)):
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            yield from paths_of(child, (*path, key))


def at(data: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        data = data[part]
    return data


@st.composite
def mutated_profile(draw: st.DrawFn) -> str:
    """A bundled profile with one to three mutations, dumped back to YAML."""
    data = copy.deepcopy(PARSED[draw(st.sampled_from(sorted(PARSED)))])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(paths_of(data))))
        action = draw(st.sampled_from(["drop", "swap", "swap", "add"]))
        if action == "drop" and path:
            del at(data, path[:-1])[path[-1]]
        elif action == "add" and isinstance(at(data, path), dict):
            at(data, path)[draw(NEW_KEYS)] = draw(VALUES)
        elif path:
            at(data, path[:-1])[path[-1]] = draw(VALUES)
    return yaml.safe_dump(data, allow_unicode=draw(st.booleans()), sort_keys=False)


@st.composite
def damaged_text(draw: st.DrawFn) -> bytes:
    """A bundled profile's bytes truncated, salted with garbage, or replaced by garbage."""
    raw = BUNDLED[draw(st.sampled_from(sorted(BUNDLED)))].encode()
    cut = draw(st.integers(0, len(raw)))
    kind = draw(st.sampled_from(["truncate", "insert", "replace", "garbage", "nest", "line"]))
    if kind == "truncate":
        return raw[:cut]
    if kind == "insert":
        return raw[:cut] + draw(st.binary(min_size=1, max_size=16)) + raw[cut:]
    if kind == "replace":
        return raw[:cut] + draw(st.binary(min_size=1, max_size=16)) + raw[cut + 16 :]
    if kind == "garbage":
        return draw(st.binary(max_size=256))
    if kind == "nest":
        depth = draw(st.integers(30, 600))
        opener, closer = draw(st.sampled_from([("[", "]"), ("{a: ", "}")]))
        return raw + b"\npreload: " + (opener * depth + closer * depth).encode()
    line = draw(st.text(max_size=40)).encode("utf-8", "surrogatepass")
    return raw[:cut] + b"\n" + line + b"\n" + raw[cut:]


# ------------------------------------------------------------------ tests


@settings(FUZZ, max_examples=4000)
@given(text=mutated_profile())
def test_mutated_profiles_load_or_fail_in_one_line(fuzz_dir: Path, text: str) -> None:
    check_text(fuzz_dir, text)


@settings(FUZZ, max_examples=1500)
@given(raw=damaged_text())
def test_damaged_profile_text_loads_or_fails_in_one_line(fuzz_dir: Path, raw: bytes) -> None:
    check_text(fuzz_dir, raw)


@pytest.mark.parametrize(
    ("field", "value"),
    [("start_timeout", '""'), ("start_timeout", "[1]"), ("start_timeout", "{a: 1}")]
    + [("death_timeout", v) for v in ('""', "[1]", ".nan", ".inf", "1e400")]
    + [("memory", v) for v in ('""', "[1]", "infGB", "1e400GB", "-1")]
    + [("walltime", v) for v in ('""', "[1]", "{}", "null")]
    + [("workers", "1" * 5000), ("description", f"\n  ? {LONG}\n  : 1"), ("queue", f"[{LONG}]")]
    + [("preload", "[" * 5000 + "]" * 5000), ("protocol", '"a\\u2028b"'), ("env", "{a: [1]}")],
)
def test_reported_cases(fuzz_dir: Path, field: str, value: str) -> None:
    """The issue's examples, each as its own case: a located one-line error, never a crash."""
    data = {k: v for k, v in PARSED["slurm-gpu"].items() if k != field}
    text = yaml.safe_dump(data, sort_keys=False)
    path = fuzz_dir / "reported.yaml"
    path.write_text(f"{text}\n{field}: {value}\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    line = info.value.one_line()
    assert line.startswith(f"{path.name}:") or f"/{path.name}:" in line, line
    assert re.search(rf": {field}[.:\[]", line), line  # names the field (or a key below it)
    assert len(line.splitlines()) == 1 and len(line) <= MAX_LINE, line


# ------------------------------------------------------------------ CLI arguments


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    from clusterkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exited:
            code = exited.code
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


WORDS = st.sampled_from(
    ["profiles", "validate", "show", "render", "list", "status", "down", "scale", "logs", "ls",
     "--json", "--all", "--help", "-h", "--no-such", "-x", "--", "-", "local", "slurm-gpu",
     "no-such-cluster", "../x", "x.yaml", "/nonexistent/p.yaml", "-1", "0", "1e9", "nan",
     "10**400", LONG[:300], "", " ", "é\u2028", "a\nb", "--workers", "--tail", "NAME"]
)  # fmt: skip
VERBS = st.sampled_from(
    [["profiles", "validate"], ["profiles", "show"], ["profiles", "render"], ["profiles", "list"],
     ["status"], ["down"], ["scale"], ["logs"], ["ls"], ["profiles"], [], ["no-such-command"]]
)  # fmt: skip


@settings(
    FUZZ,
    max_examples=400,
    suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture],
)
@given(verb=VERBS, args=st.lists(st.one_of(WORDS, st.text(max_size=12)), max_size=4))
def test_cli_arguments_exit_cleanly(isolated_state: Path, verb: list[str], args: list[str]) -> None:
    code, out, err = run_cli([*verb, *args])
    assert "Traceback" not in out + err, (verb, args, err[-500:])
    if code == 0:
        return
    lines = err.splitlines()
    assert code in (1, 2), (verb, args, code, err[-500:])
    # `profiles validate A B` reports each profile: one line per name given, never more
    most = len(args) if verb == ["profiles", "validate"] else 1
    assert 1 <= len(lines) <= max(most, 1), (verb, args, err[-500:])
    for line in lines:
        assert line.startswith("error: ") and len(line) <= MAX_LINE, (verb, args, line[:400])
    assert not any(isolated_state.iterdir()), (verb, args, list(isolated_state.iterdir()))
