"""A DaskCluster's pods as stages (pending, scheduled, pulling, running, connected) and why."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from clusterkit.backends.kubernetes.api import INSTALL_OPERATOR, kind
from clusterkit.errors import ClusterStartError

POLL = 0.25


@dataclass
class PodView:
    name: str
    component: str
    phase: str
    ready: bool
    stage: str
    reason: str


def pod_views(api: Any, name: str, namespace: str) -> list[PodView]:
    """The cluster's pods with their stage (pending, scheduled, pulling, running, connected)."""
    import kr8s

    pods = list(
        kr8s.get(
            "pods", namespace=namespace, api=api, label_selector={"dask.org/cluster-name": name}
        )
    )
    events = _events(api, namespace, {p.name for p in pods})
    views = []
    for pod in pods:
        status = pod.raw.get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        ready = conditions.get("Ready", {}).get("status") == "True"
        reasons = [e["reason"] for e in events.get(pod.name, [])]
        warnings = [e["message"] for e in events.get(pod.name, []) if e.get("type") == "Warning"]
        phase = status.get("phase", "Pending")
        waiting = [
            c["state"]["waiting"]
            for c in status.get("containerStatuses", [])
            if "waiting" in c.get("state", {})
        ]
        if ready:
            stage = "connected"
        elif phase == "Running" and not waiting:
            stage = "running"
        elif waiting:
            stage = "running"
            warnings.append(f"{waiting[0].get('reason')}: {waiting[0].get('message', '')}")
        elif "Pulling" in reasons or "Pulled" in reasons:
            stage = "pulling"
        elif conditions.get("PodScheduled", {}).get("status") == "True" or "Scheduled" in reasons:
            stage = "scheduled"
        else:
            stage = "pending"
        unscheduled = conditions.get("PodScheduled", {})
        if unscheduled.get("status") == "False" and unscheduled.get("message"):
            warnings.append(unscheduled["message"])
        views.append(
            PodView(
                pod.name,
                pod.labels.get("dask.org/component", "?"),
                phase,
                ready,
                stage,
                warnings[-1] if warnings else "",
            )
        )
    return views


def _events(api: Any, namespace: str, pods: set[str]) -> dict[str, list[dict[str, Any]]]:
    import kr8s

    found: dict[str, list[dict[str, Any]]] = {}
    for event in kr8s.get("events", namespace=namespace, api=api):
        involved = event.raw.get("involvedObject", {})
        if involved.get("kind") == "Pod" and involved.get("name") in pods:
            found.setdefault(involved["name"], []).append(event.raw)
    return found


def wait_for_pods(api: Any, name: str, namespace: str, workers: int, deadline: float) -> None:
    """Until the scheduler pod is ready and ``workers`` worker pods run; else say why."""
    while True:
        pods = pod_views(api, name, namespace)
        scheduler = [p for p in pods if p.component == "scheduler"]
        running = [
            p
            for p in pods
            if p.component == "worker"
            and p.phase == "Running"
            and p.stage in ("running", "connected")
            and not p.reason
        ]
        if scheduler and scheduler[0].ready and len(running) >= workers:
            return
        if time.monotonic() > deadline:
            raise stuck(api, name, namespace, pods, workers, len(running))
        time.sleep(POLL)


def stuck(
    api: Any, name: str, namespace: str, pods: list[PodView], workers: int, running: int
) -> ClusterStartError:
    evidence = [f"{p.name}: {p.stage} ({p.phase}) {p.reason}".rstrip() for p in pods]
    blocked = [p for p in pods if p.reason]
    if not pods:
        phase = cluster_phase(api, name, namespace)
        why = (
            "the DaskCluster was never actioned: is the dask operator running?"
            if not phase
            else f"the operator created no pods (DaskCluster phase {phase})"
        )
        return ClusterStartError(
            why,
            component="kubernetes",
            evidence=evidence,
            hint=INSTALL_OPERATOR if not phase else None,
        )
    if blocked:
        pod = blocked[0]
        return ClusterStartError(
            f"pod {pod.name} is {pod.stage}: {pod.reason}",
            component=pod.component,
            evidence=evidence,
        )
    return ClusterStartError(
        f"{running} of {workers} worker pods running before the start timeout",
        component="workers",
        evidence=evidence,
    )


def cluster_phase(api: Any, name: str, namespace: str) -> str | None:
    try:
        cluster = kind("DaskCluster").get(name, namespace=namespace, api=api)
    except Exception:
        return None
    return cluster.raw.get("status", {}).get("phase")
