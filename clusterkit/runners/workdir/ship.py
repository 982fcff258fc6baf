"""Driver side: make the project ready on every worker, and on workers that join later.

``ship`` asks each worker whether it sees the project in place or holds a current copy; for
each cache directory that lacks files (workers sharing one need a single upload) it sends
only the missing contents, through the scheduler (``client.run``), then registers a worker
plugin so a worker that joins later fetches the files from a peer before it runs anything.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

from clusterkit.runners.workdir import tree
from clusterkit.runners.workdir.project import Project

if TYPE_CHECKING:
    from distributed import Client

log = logging.getLogger(__name__)

_BATCH = 16 * 2**20  # bytes per upload message
_HANDLER = "clusterkit_workdir_blobs"


@dataclass
class Shipment:
    """What ``ship`` did: each worker's mode ("in-place" or "synced") and the bytes sent."""

    modes: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0


def _batches(project: Project, digests: list[str]) -> list[dict[str, bytes]]:
    paths = {f.digest: os.path.join(project.root, f.path) for f in project.files}
    batches: list[dict[str, bytes]] = [{}]
    size = 0
    for digest in digests:
        with open(paths[digest], "rb") as handle:
            data = handle.read()
        if size and size + len(data) > _BATCH:
            batches.append({})
            size = 0
        batches[-1][digest] = data
        size += len(data)
    return batches


def ship(client: Client, project: Project) -> Shipment:
    """Make ``project`` ready on every worker of ``client``'s cluster; see the module doc."""
    result = Shipment()
    probes = client.run(tree.probe, project)
    uploaded: set[str] = set()
    for worker, found in sorted(probes.items()):
        if found["mode"] != "missing" or found["store"] in uploaded:
            continue
        for batch in _batches(project, found["missing"]):
            sent = client.run(tree.receive, batch, workers=[worker])
            result.bytes_sent += sum(sent.values())
        uploaded.add(found["store"])
    if uploaded:
        probes = client.run(tree.probe, project)
    result.modes = {w: p["mode"] for w, p in probes.items()}
    left = sorted(w for w, mode in result.modes.items() if mode == "missing")
    if left:
        raise RuntimeError(f"project {project.root} could not be copied to {left}")
    client.register_plugin(ProjectPlugin(project), name=f"clusterkit-workdir-{project.key[:16]}")
    log.info("project %s: %s; %d bytes sent", project.root, result.modes, result.bytes_sent)
    say_where_copied(project, probes)
    return result


def say_where_copied(project: Project, probes: dict[str, dict[str, Any]]) -> None:
    """One line when workers run in a copy of the project: where, and why not in place."""
    copied = {w: p for w, p in probes.items() if p["mode"] == "synced"}
    if not copied:
        return
    where = ", ".join(sorted({str(p["directory"]) for p in copied.values()}))
    differs = sorted({p["differs"] for p in copied.values() if p.get("differs")})
    if project.copy:
        why = "a copy was asked for (CLUSTERKIT_WORKDIR_COPY)"
    elif differs:
        why = f"{differs[0]} differs there from {project.root}"
    else:
        why = f"they do not see {project.root}"
    log.warning(
        "project %s: %d of %d workers run in a copy at %s (%s); files written there stay there",
        project.root,
        len(copied),
        len(probes),
        where,
        why,
    )


def reship(client: Client, old: Project) -> Project:
    """Scan and ship ``old``'s directory again (a restart after files changed on disk, so
    that replacement workers find it too); the cap is not applied a second time."""
    from clusterkit.runners.workdir.project import scan

    project = scan(old.root, max_size=max(old.size * 4, 2**30), copy=old.copy)
    ship(client, project)
    return project


class ProjectPlugin(WorkerPlugin):
    """Serves the project's files to peers; a new worker fetches them before it runs tasks."""

    def __init__(self, project: Project) -> None:
        self.project = project

    async def setup(self, worker: Any) -> None:
        worker.handlers[_HANDLER] = _serve
        found = await _offload(worker, tree.probe, self.project)
        if found["mode"] != "missing":
            return
        wanted = set(found["missing"])
        info = await worker.scheduler.identity(n_workers=-1)
        for peer in sorted(info.get("workers", {})):
            if peer == worker.address or not wanted:
                continue
            try:
                blobs = await worker.rpc(peer).clusterkit_workdir_blobs(
                    key=self.project.key, digests=sorted(wanted)
                )
            except Exception as error:  # a peer without the handler or gone: try the next
                log.debug("peer %s has no project files: %s", peer, error)
                continue
            await _offload(worker, tree.receive, blobs)
            wanted -= set(blobs)
        found = await _offload(worker, tree.probe, self.project)
        if found["mode"] == "missing":
            log.warning("project %s: no peer had %d files", self.project.root, len(wanted))


async def _serve(key: str, digests: list[str]) -> dict[str, bytes]:
    return tree.read_blobs(key, digests)


async def _offload(worker: Any, function: Callable[..., Any], *args: Any) -> Any:
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, function, *args)
