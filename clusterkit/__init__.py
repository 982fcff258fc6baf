"""clusterkit: Dask clusters from named profiles, one get_client(), ML runners on top.

The public names are imported lazily so that ``import clusterkit`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "ClusterkitError",
    "Profile",
    "cluster",
    "down",
    "get_client",
    "load_profile",
    "status",
    "up",
]

_LAZY = {
    "get_client": "clusterkit.client",
    "cluster": "clusterkit.client",
    "load_profile": "clusterkit.profiles",
    "up": "clusterkit.api",
    "down": "clusterkit.api",
    "status": "clusterkit.api",
    "Profile": "clusterkit.profiles",
    "ClusterkitError": "clusterkit.errors",
}

if TYPE_CHECKING:
    from clusterkit.api import down, status, up
    from clusterkit.client import cluster, get_client
    from clusterkit.errors import ClusterkitError
    from clusterkit.profiles import Profile, load_profile


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'clusterkit' has no attribute {name!r}")
