"""Where profiles are found (the search path, first hit wins) and what a name may be.

Kept apart from ``profiles`` (which loads and validates them) so that shell completion of
profile names and the commands that only name a cluster import neither pydantic nor YAML.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from clusterkit.errors import ProfileError, shorten

BUNDLED_DIR = Path(__file__).parent / "bundled_profiles"
SUFFIXES = (".yaml", ".yml")
#: A profile or cluster name: it becomes a file name, so no path separators.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def check_name(name: str) -> None:
    if not NAME_PATTERN.match(name) or ".." in name:
        raise ProfileError(
            f"profile name {shorten(name)} is not a plain name",
            hint="use letters, digits, '-', '_' and '.', without path separators",
        )


def search_path() -> list[Path]:
    """Profile directories, first hit wins."""
    dirs = [Path.cwd() / "profiles"]
    dirs += [Path(p) for p in os.environ.get("CLUSTERKIT_PROFILES", "").split(os.pathsep) if p]
    dirs.append(Path.home() / ".config" / "clusterkit" / "profiles")
    dirs.append(BUNDLED_DIR)
    return dirs


def discover() -> dict[str, Path]:
    """Every profile name on the search path, mapped to the file that wins."""
    found: dict[str, Path] = {}
    for directory in search_path():
        if not directory.is_dir():
            continue
        for file in sorted(directory.iterdir()):
            if file.suffix in SUFFIXES and file.stem not in found:
                found[file.stem] = file
    return found
