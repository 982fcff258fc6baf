"""dask-cuda options a profile passes through (``cuda:``), checked against the installed
dask-cuda: ``LocalCUDACluster`` keywords for ``local-cuda``, ``dask cuda worker`` options for GPU
workers elsewhere (job scripts, pods, SSH hosts). Options clusterkit sets from its own fields
are refused with the field to use. Without dask-cuda installed (a login node rendering a GPU
profile) names cannot be checked and pass as written.
"""

from __future__ import annotations

import difflib
import inspect
from functools import cache
from typing import Any

from clusterkit.errors import cut

#: Options clusterkit derives from profile fields, by option name -> the field to set instead.
MANAGED = {
    "CUDA_VISIBLE_DEVICES": "devices",
    "n_workers": "workers",
    "threads_per_worker": "worker.threads",
    "nthreads": "worker.threads",
    "memory_limit": "worker.memory",
    "protocol": "protocol",
    "enable_tcp_over_ucx": "protocol: ucx",
    "enable_infiniband": "ucx.infiniband",
    "enable_nvlink": "ucx.nvlink",
    "enable_rdmacm": "ucx.rdmacm",
    "interface": "interface",
    "host": "interface",
    "death_timeout": "death_timeout",
    "preload": "preload",
    "preload_argv": "preload",
    "resources": "worker.resources",
    "name": "(the worker name)",
    "scheduler": "(the scheduler address)",
    "scheduler_file": "(the scheduler address)",
    "tls_ca_file": "protocol: tls",
    "tls_cert": "protocol: tls",
    "tls_key": "protocol: tls",
    "local_directory": "local_directory",
    "dashboard": "scheduler.dashboard",
    "dashboard_address": "scheduler.dashboard_port",
}
#: ``dask cuda worker`` options its CLI turns into dask config, not CUDAWorker keywords.
CONFIG_OPTIONS = {"multiprocessing_method": "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"}
#: Options that local-cuda sets from its own fields (elsewhere they pass through).
LOCAL_CUDA_FIELDS = (
    "device_memory_limit",
    "enable_cudf_spill",
    "rmm_pool_size",
    "rmm_managed_memory",
    "rmm_async",
)


@cache
def cluster_options() -> frozenset[str] | None:
    """``LocalCUDACluster``'s keywords, or None without dask-cuda."""
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        return None
    names = inspect.signature(LocalCUDACluster.__init__).parameters
    return frozenset(n for n in names if n not in {"self", "kwargs"})


@cache
def worker_parameters() -> dict[str, Any] | None:
    """``dask cuda worker``'s click parameters by name, or None without dask-cuda."""
    try:
        from dask_cuda.cli import worker
    except ImportError:
        return None
    return {p.name: p for p in worker.params if p.name}


def check(options: dict[str, Any], local: bool) -> None:
    """Raise ValueError, with a did-you-mean, for an option dask-cuda does not have here."""
    known = cluster_options() if local else _names(worker_parameters())
    managed = {**MANAGED, **({name: name for name in LOCAL_CUDA_FIELDS} if local else {})}
    for name, value in options.items():
        shown = cut(str(name), 60)
        if name in managed:
            raise ValueError(f"{shown} is set by clusterkit: use the profile's {managed[name]}")
        if known is None:
            continue
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known - managed.keys()), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            what = "LocalCUDACluster" if local else "`dask cuda worker`"
            raise ValueError(f"{shown}: not an option of {what} in this dask-cuda{hint}")
        if not local:
            worker_flags({name: value})  # the option's own type check


def worker_flags(options: dict[str, Any]) -> list[str]:
    """``dask cuda worker`` flags for ``options``, each value checked by the option's type."""
    parameters = worker_parameters()
    flags: list[str] = []
    for name, value in options.items():
        parameter = parameters.get(name) if parameters else None
        flag = parameter.opts[0] if parameter else "--" + name.replace("_", "-")
        if isinstance(value, bool):
            negative = parameter.secondary_opts if parameter else []
            if value or negative:
                flags.append(flag if value else negative[0])
            continue
        text = _as_text(value)
        if parameter is not None:
            try:
                parameter.type.convert(text, parameter, None)
            except Exception as error:
                message = getattr(error, "message", None) or str(error)
                raise ValueError(f"{cut(name, 60)}: {cut(message, 200)}") from None
        flags += [flag, text]
    return flags


def worker_keywords(options: dict[str, Any]) -> dict[str, Any]:
    """``dask_cuda.CUDAWorker`` keywords for ``options``, each value as ``dask cuda worker``'s
    own parser makes it (``"torch,cupy"`` -> a list), less those its CLI sets as dask config."""
    parameters = worker_parameters() or {}
    keywords: dict[str, Any] = {}
    for name, value in options.items():
        if name in CONFIG_OPTIONS:
            continue
        parameter = parameters.get(name)
        if parameter is not None and not isinstance(value, bool):
            value = parameter.type.convert(_as_text(value), parameter, None)
        keywords[name] = value
    return keywords


def worker_config_env(options: dict[str, Any]) -> dict[str, str]:
    """The environment that sets the dask config ``dask cuda worker`` makes of ``options``."""
    return {
        CONFIG_OPTIONS[name]: str(value)
        for name, value in options.items()
        if name in CONFIG_OPTIONS
    }


def _as_text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _names(parameters: dict[str, Any] | None) -> frozenset[str] | None:
    return None if parameters is None else frozenset(parameters)
