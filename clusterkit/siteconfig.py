"""A site's Dask configuration under a profile: the profile wins, Dask config fills the rest.

Batch sites keep their queue, account, walltime and job directives in Dask config
(``~/.config/dask/jobqueue.yaml``, ``/etc/dask/``, ``DASK_JOBQUEUE__SLURM__QUEUE=...``), as
dask-jobqueue's documentation recommends. Each option of a SLURM or PBS profile that the profile
(with its ``extends`` chain) leaves unset is taken from the site's ``jobqueue.<system>`` section.
A value equal to dask-jobqueue's packaged default counts as unset: dask-jobqueue copies its
defaults into ``~/.config/dask/jobqueue.yaml``, so a site's choice cannot be told from them.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

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
SECTIONS = {"slurm": "jobqueue.slurm", "pbs": "jobqueue.pbs"}


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
    found = {}
    for field, option in FIELDS.items():
        value = dask.config.get(f"{section}.{option}", default=None)
        if value is None or value == [] or value == defaults.get(option):
            continue
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


def explain(ref: str) -> list[tuple[str, str, str]]:
    """``(setting, value, source)`` for every setting of a profile; the source is the profile
    file and line, the Dask config key, ``default``, or ``derived`` (computed from others)."""
    import json

    from clusterkit.profiles import load_located

    profile, located = load_located(ref)
    rows = []
    for name, value in profile.model_dump(mode="json").items():
        nested = isinstance(value, dict) and value
        for key, item in value.items() if nested else [(None, value)]:
            path = (name,) if key is None else (name, key)
            where = located.lines.get(path)
            if where:
                source = f"{where[0]}:{where[1]}"
            elif name in located.filled:
                source = f"Dask config {located.filled[name]}"
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
