"""A site's Dask configuration under a profile: the profile wins, Dask config fills the rest.

Batch sites keep their queue, account, walltime and job directives in Dask config
(``~/.config/dask/jobqueue.yaml``, ``/etc/dask/``, ``DASK_JOBQUEUE__SLURM__QUEUE=...``), as
dask-jobqueue's documentation recommends. Each option of a SLURM, PBS, Grid Engine or HTCondor
profile that the profile (with its ``extends`` chain) leaves unset is taken from the site's
``jobqueue.<system>`` section (Grid Engine's ``project`` is the profile's ``account``).
A value equal to dask-jobqueue's packaged default counts as unset: dask-jobqueue copies its
defaults into ``~/.config/dask/jobqueue.yaml``, so a site's choice cannot be told from them.

A leaf: ``profiles`` calls it while loading, and it calls nothing of clusterkit's back.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterkit.yamlmap import Located

#: Profile field -> dask-jobqueue option, for the options a profile can set.
FIELDS = {
    "queue": "queue",
    "account": "account",
    "walltime": "walltime",
    "cores": "cores",
    "memory": "memory",
    "processes": "processes",
    "interface": "interface",
    "local_directory": "local-directory",
    "log_directory": "log-directory",
    "python": "python",
    "death_timeout": "death-timeout",
    "job_extra": "job-extra-directives",
    "prologue": "job-script-prologue",
}
SECTIONS = {system: f"jobqueue.{system}" for system in ("slurm", "pbs", "sge", "htcondor")}
#: Options only some systems' profiles have: ``(backend, field) -> dask-jobqueue option``.
EXTRA_FIELDS = {
    ("sge", "account"): "project",
    ("sge", "resource_spec"): "resource-spec",
    ("htcondor", "disk"): "disk",
}


@cache
def _packaged_defaults(section: str) -> dict[str, Any]:
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("dask_jobqueue")  # its file, without importing distributed
    if spec is None or spec.origin is None:
        return {}
    data = yaml.safe_load((Path(spec.origin).parent / "jobqueue.yaml").read_text())
    for part in section.split("."):
        data = data.get(part) or {}
    return dict(data)


def site_values(backend: str) -> dict[str, tuple[Any, str]]:
    """``{field: (value, dask config key)}`` for what the site's Dask config sets."""
    section = SECTIONS.get(backend)
    if section is None:
        return {}
    import dask

    defaults = _packaged_defaults(section)
    extra = {field: option for (system, field), option in EXTRA_FIELDS.items() if system == backend}
    found = {}
    for field, option in {**FIELDS, **extra}.items():
        value = dask.config.get(f"{section}.{option}", default=None)
        if value is None or value in ([], {}) or value == defaults.get(option):
            continue
        if isinstance(value, dict):  # HTCondor's submit commands
            value = [f"{key} = {item}" for key, item in value.items()]
        found[field] = (value, f"{section}.{option}")
    return found


def fill(data: dict[str, Any], backend: str) -> dict[str, str]:
    """Set each field ``data`` lacks from the site's Dask config; ``{field: config key}``."""
    filled = {}
    for field, (value, key) in site_values(backend).items():
        if field not in data:
            data[field] = value
            filled[field] = key
    return filled


def explain(profile: Any, located: Located) -> list[tuple[str, str, str]]:
    """``(setting, value, source)`` for every setting of a profile as ``profiles.load_located``
    returns it; the source is the profile file and line, the Dask config key, ``default``, or
    ``derived`` (computed from others)."""
    import json

    lines, filled = located.lines, located.filled
    rows = []
    for name, value in profile.model_dump(mode="json").items():
        nested = isinstance(value, dict) and value
        for key, item in value.items() if nested else [(None, value)]:
            path = (name,) if key is None else (name, key)
            where = lines.get(path)
            if where:
                source = f"{where[0]}:{where[1]}"
            elif name in filled:
                source = f"Dask config {filled[name]}"
            else:
                source = "default" if item == _default(profile, path) else "derived"
            shown = item if isinstance(item, str) else json.dumps(item)
            rows.append((".".join(str(p) for p in path), shown, source))
    return rows


def _default(profile: Any, path: tuple[str, ...]) -> Any:
    """The schema's default for a setting, as JSON data (None when it has none)."""
    from pydantic import BaseModel

    model: Any = type(profile)
    for part in path[:-1]:
        model = getattr(profile, part)
        if not isinstance(model, BaseModel):
            return None
        model = type(model)
    info = model.model_fields.get(path[-1])
    if info is None or info.is_required():
        return None
    value = info.get_default(call_default_factory=True)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
