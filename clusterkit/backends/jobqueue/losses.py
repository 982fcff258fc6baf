"""Workers a batch cluster lost, for ``status``: a worker whose connection closed or went silent
while it was running (its node died, was cut off, or its process was killed), not one that left
by itself (its lifetime's end, a retirement, ``scale`` down). Each loss is kept with its job,
the node the batch system ran that job on, the time and the cause:
``worker ck-0 of job 7 on node n3 at 06:41:12 (its connection closed)``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from clusterkit.backends.jobqueue.commands import BatchQueue

#: The scheduler's stimulus for a removal, by how it starts, and what it means for a worker
#: that had not said it was leaving.
CAUSES = {
    "handle-worker-cleanup": "its connection closed",
    "check-worker-ttl": "no heartbeat within distributed.scheduler.worker-ttl",
}
#: Statuses a worker reports before it leaves by itself.
LEAVING = {"closing", "closing_gracefully", "closed"}
#: Losses kept (the newest).
KEPT = 100


@dataclass
class Loss:
    worker: str
    job: str
    node: str
    at: float
    why: str

    def line(self) -> str:
        job = f" of job {self.job}" if self.job else ""
        stamp = time.strftime("%H:%M:%S", time.localtime(self.at))
        return f"worker {self.worker}{job} on {self.node} at {stamp} ({self.why})"


def _left_by_itself(scheduler: Any, address: str) -> bool:
    """Whether the worker said it was leaving before its removal (the scheduler's events)."""
    for _, event in reversed(scheduler.get_events(address)):
        if event.get("action") == "remove-worker" and event.get("expected"):
            return True
        if event.get("action") == "worker-status-change":
            return event.get("status") in LEAVING
    return False


def cause(scheduler: Any, address: str, stimulus_id: str) -> str | None:
    """Why the worker at ``address`` was lost, or None: it was not (it left by itself)."""
    why = next((text for prefix, text in CAUSES.items() if stimulus_id.startswith(prefix)), None)
    if why is None or _left_by_itself(scheduler, address):
        return None
    return why


def job_of(cluster: Any, worker: str) -> str:
    """The batch job id of a worker name (``NAME-i``, or ``NAME-i-k`` in a job of several)."""
    jobs = getattr(cluster, "workers", {})
    job = jobs.get(worker) or jobs.get(worker.rsplit("-", 1)[0])
    return str(getattr(job, "job_id", None) or "")


class LostWorkers(SchedulerPlugin):
    """Records each lost worker in ``cluster.losses``. The node of each worker's job is asked
    of the batch queue when the worker joins (batched, off the event loop), while the queue
    still answers: a node cut off may take the batch system's controller with it; ``status``
    adds what it sees (``cluster.job_nodes``), and a loss whose node is still unknown asks."""

    name = "clusterkit-lost-workers"

    def __init__(self, cluster: Any, queue: BatchQueue) -> None:
        self.cluster = cluster
        self.queue = queue
        self.seen: dict[str, tuple[str, str, str]] = {}  # address -> (name, host, job)
        self.nodes: dict[str, str] = {}  # job -> its node(s)
        self.asking: set[str] = set()  # jobs whose node is to be asked
        cluster.losses = []
        cluster.job_nodes = self.nodes

    def add_worker(self, scheduler: Any, worker: str) -> None:
        state = scheduler.workers.get(worker)
        if state is None:
            return
        job = job_of(self.cluster, str(state.name))
        self.seen[worker] = (str(state.name), str(state.host), job)
        if job:  # asked again for each worker: a requeued job may run on another node
            if not self.asking:  # one query for the workers joining within a second
                asyncio.get_running_loop().call_later(1.0, self._ask)
            self.asking.add(job)

    def _ask(self) -> None:
        jobs, self.asking = sorted(self.asking), set()
        asyncio.get_running_loop().run_in_executor(None, self._find_nodes, jobs)

    def _find_nodes(self, jobs: list[str]) -> None:
        for job, info in self.queue.jobs(jobs).items():
            if info.nodes:
                self.nodes[job] = info.nodes

    def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str, **_: Any) -> None:
        name, host, job = self.seen.pop(worker, (worker, worker, ""))
        why = cause(scheduler, worker, stimulus_id)
        if why is None:
            return
        node = f"node {self.nodes[job]}" if job in self.nodes else f"host {host}"
        loss = Loss(name, job, node, time.time(), why)
        losses: list[Loss] = self.cluster.losses
        losses.append(loss)
        del losses[:-KEPT]
        if job and job not in self.nodes:
            asyncio.get_running_loop().run_in_executor(None, self._find_node, loss)

    def _find_node(self, loss: Loss) -> None:
        self._find_nodes([loss.job])
        if loss.job in self.nodes:
            loss.node = f"node {self.nodes[loss.job]}"
