"""clusterkit: Dask clusters from named profiles, one get_client(), ML runners on top.

The public names are imported lazily so that ``import clusterkit`` stays cheap.

Layers, from the top. A module imports only from its own layer and the layers below it, the
imports inside functions (kept lazy for start-up time) included; only ``if TYPE_CHECKING:``
blocks are exempt. No circle among modules, and no private name (``_x``) crosses a module
boundary. A lower layer that must reach a higher one calls a hook the higher one registers
(``lifecycle.hooks``). ``tests/test_layout.py`` reads this list and holds every import to it.

1. ``cli``, ``__main__``: the typer app and ``python -m clusterkit``, thin over the library
2. ``runs``: detached runs and whole runs in one batch job
3. ``runners``: the search (hpo), distributed training (ddp), the project shipped to workers
4. ``api``, ``client``, ``doctor``, ``clusterkit``: the lifecycle verbs, get_client(), the
   doctor's checks, this package's lazy public names
5. ``lifecycle``: the one start path, the supervisor, the control socket, spawning, hooks
6. ``backends``: the Backend base class, each backend, and ``backends.jobqueue``'s core
   under its batch systems
7. ``profiles``, ``schema``, ``security``, ``webauth``, ``state``, ``siteconfig``,
   ``registry``, ``exporters``, ``monitor``: profiles and their models, TLS, the web pages'
   secret, the state directory, the site's Dask config, which backends exist, profile exports
   (Helm values, tfvars), the shaping of what a scheduler reports
8. ``units``, ``errors``, ``console``, ``capacity``, ``searchpath``, ``yamlmap``: the leaves
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "ClusterkitError",
    "Profile",
    "cluster",
    "dashboard_link",
    "down",
    "get_client",
    "load_profile",
    "status",
    "up",
]

_LAZY = {
    "get_client": "clusterkit.client",
    "cluster": "clusterkit.client",
    "dashboard_link": "clusterkit.client",
    "load_profile": "clusterkit.profiles",
    "up": "clusterkit.api",
    "down": "clusterkit.api",
    "status": "clusterkit.api",
    "Profile": "clusterkit.profiles",
    "ClusterkitError": "clusterkit.errors",
}

if TYPE_CHECKING:
    from clusterkit.api import down, status, up
    from clusterkit.client import cluster, dashboard_link, get_client
    from clusterkit.errors import ClusterkitError
    from clusterkit.profiles import Profile, load_profile


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'clusterkit' has no attribute {name!r}")
