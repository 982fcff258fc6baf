"""Rich renderings of what the library returns (status tables)."""

from __future__ import annotations

from typing import Any


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}%"


def _gpu_memory(row: dict[str, Any]) -> str:
    from dask.utils import format_bytes

    used, total = row["gpu_memory_used"], row["gpu_memory_total"]
    if used is None:
        return ""
    return format_bytes(used) + (f" / {format_bytes(total)}" if total else "")


def status_view(info: dict[str, Any]) -> Any:
    """The header line, the workers table and the backend's rows (jobs, pods)."""
    from dask.utils import format_bytes
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    header = f"{info['name']} ({info['backend']}) at {info['address']}, {info.get('mode') or ''}"
    header += f", GPUs busy {info['gpus_busy']}/{info['gpus']}" if info.get("gpus") else ""
    header += f", dashboard {info['dashboard']}" if info["dashboard"] else ""
    workers = Table(title="workers", title_justify="left", header_style="bold")
    columns = ["worker", "threads", "CPU", "memory", "GPUs", "GPU use", "GPU memory"]
    for column in [*columns, "running", "queued"]:
        workers.add_column(column)
    for w in info["workers"]:
        memory = f"{format_bytes(w['memory'] or 0)} / {format_bytes(w['memory_limit'] or 0)}"
        workers.add_row(
            *(
                str(cell)
                for cell in (
                    w["name"] if w["name"] not in ("None", w["address"]) else w["address"],
                    w["threads"],
                    _percent(w["cpu"]),
                    memory,
                    w["gpus"],
                    _percent(w["gpu_utilization"]),
                    _gpu_memory(w),
                    w["running"],
                    w["queued"],
                )
            )
        )
    parts: list[Any] = [Text(header.replace(", ,", ",").rstrip(", ")), workers]
    shown = [r for r in info["rows"] if r["kind"] != "lost"]
    if shown:
        rows = Table(header_style="bold")
        for column in ("kind", "name", "state", "detail"):
            rows.add_column(column)
        for r in shown:
            rows.add_row(r["kind"], r["name"], r["state"], r["detail"])
        parts.append(rows)
    # workers lost (a batch cluster's), one line each: "lost: worker W of job J on node N at T"
    parts += [Text(f"lost: {r['detail']}") for r in info["rows"] if r["kind"] == "lost"]
    return Group(*parts)
