"""Hooks: calls that the layers above lifecycle register for moments of a cluster's life, so
that lifecycle and api reach them without importing them.

A hook takes the cluster's name and returns the IDs of what it acted on. A layer registers its
hooks as entry points of these groups in clusterkit's ``pyproject.toml``, which every process
reads, a supervisor started fresh included:

- ``clusterkit.watch``: a supervisor calls each one every few seconds while its scheduler
  answers (``clusterkit.runs`` resumes the runs on the cluster whose monitor died);
- ``clusterkit.before_down``: ``down`` calls each one before it stops the cluster
  (``clusterkit.runs`` stops the runs on it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

WATCH = "clusterkit.watch"
BEFORE_DOWN = "clusterkit.before_down"

Hook = Callable[[str], list[str]]


@functools.cache
def registered(group: str) -> tuple[Hook, ...]:
    """The hooks of ``group`` in the order of their names, loaded once per process (from
    clusterkit's own metadata: ~0.2 ms, where a scan of every installed package takes ~5)."""
    from importlib.metadata import distribution

    found = distribution("clusterkit").entry_points.select(group=group)
    return tuple(ep.load() for ep in sorted(found, key=lambda ep: ep.name))


def call(group: str, cluster: str) -> list[str]:
    """Every hook of ``group`` on ``cluster``, in turn; the IDs they acted on."""
    return [acted_on for hook in registered(group) for acted_on in hook(cluster)]
