"""Shell completion of profile names (every search path) and cluster names (records)."""

from __future__ import annotations


def profile_names(incomplete: str) -> list[str]:
    """Profiles found on the search path that start with what was typed."""
    try:
        from clusterkit.searchpath import discover

        return sorted(name for name in discover() if name.startswith(incomplete))
    except Exception:  # completion must never print a traceback into the shell
        return []


def cluster_names(incomplete: str) -> list[str]:
    """Clusters with a record (up, dead or unreadable) that start with what was typed."""
    try:
        from clusterkit import state

        names = {path.stem for path in state.clusters_dir().glob("*.json")}
        return sorted(name for name in names if name.startswith(incomplete))
    except Exception:
        return []
