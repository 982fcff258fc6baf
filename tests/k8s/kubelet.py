"""A kubelet (plus kube-scheduler and load balancer) shim for the emulator.

It polls the Deployments the dask operator creates, schedules one Pod per Deployment onto a
single emulated Node (honouring nodeSelector and extended resources such as nvidia.com/gpu, and
leaving unschedulable pods Pending with a FailedScheduling event), runs the container's real
``dask scheduler`` / ``dask worker`` command as a process on 127.0.0.1, writes Pod phases,
conditions and Events, mounts Secret volumes as files, and gives the scheduler Service its real
loopback ports and a LoadBalancer ingress of 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import re
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kr8s
from kr8s.asyncio.objects import Deployment, Event, Node, Pod, Secret, Service

logger = logging.getLogger("kubelet")

NODE_NAME = "kmock-node"
NODE_LABELS = {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux"}
NODE_ALLOCATABLE = {"cpu": "2", "memory": "8Gi", "pods": "110"}
BIN = Path(sys.executable).parent
#: Flags the shim rewrites so every process binds loopback and a free port.
SCHEDULER_DROP = {"--host", "--port", "--dashboard-address", "--scheduler-file", "--interface"}
WORKER_DROP = {
    "--host",
    "--dashboard-address",
    "--listen-address",
    "--contact-address",
    "--worker-port",
    "--nanny-port",
    "--interface",
}
SERVICE_HOST = re.compile(r"^[a-z0-9-]+-scheduler\.[a-z0-9-]+(?:\.svc(?:\.cluster\.local)?)?$")


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodState:
    """One Deployment's single Pod and its process."""

    namespace: str
    deployment: str
    pod: str
    component: str
    cluster: str
    workdir: Path
    process: asyncio.subprocess.Process | None = None
    phase: str = "Pending"
    ready: bool = False
    address: str | None = None
    dashboard_port: int | None = None
    events: set[str] = field(default_factory=set)


class Kubelet:
    """Turns the operator's Deployments into processes and Pods."""

    def __init__(self, workdir: Path, log_files: dict[tuple[str, str], Path]) -> None:
        self.workdir = workdir
        self.log_files = log_files
        self.pods: dict[tuple[str, str], PodState] = {}
        #: held, so kr8s's per-loop cache (weak references) keeps one client for every call
        self.api: Any = None

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        self.api = await kr8s.asyncio.api()
        await self._ensure_node()
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("kubelet sync failed")
            await asyncio.sleep(0.3)

    async def sync(self) -> None:
        seen: set[tuple[str, str]] = set()
        # with api= given, kr8s skips its GET /version/ check on every poll
        async for deployment in kr8s.asyncio.get("deployments", namespace=kr8s.ALL, api=self.api):
            labels = deployment.labels
            if labels.get("dask.org/component") not in ("scheduler", "worker"):
                continue
            key = (deployment.namespace, deployment.name)
            seen.add(key)
            if key not in self.pods:
                await self._admit(deployment)
            await self._advance(self.pods[key], deployment.raw)
        # a cluster's pods stop together, as on a real node (each may take seconds to close)
        gone = [self.pods.pop(key) for key in set(self.pods) - seen]
        await asyncio.gather(*(self._remove(state) for state in gone))

    async def stop(self) -> None:
        await asyncio.gather(*(self._kill(state) for state in self.pods.values()))
        self.pods.clear()

    # ------------------------------------------------------------------ pod lifecycle

    async def _ensure_node(self) -> None:
        node = await Node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": NODE_NAME, "labels": NODE_LABELS},
                "status": {
                    "allocatable": NODE_ALLOCATABLE,
                    "capacity": NODE_ALLOCATABLE,
                    "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                },
            }
        )
        if not await node.exists():
            await node.create()

    async def _admit(self, deployment: Deployment) -> None:
        template = deployment.raw["spec"]["template"]
        labels = dict(template.get("metadata", {}).get("labels", {}))
        name = f"{deployment.name}-{uuid.uuid4().hex[:5]}"
        state = PodState(
            namespace=deployment.namespace,
            deployment=deployment.name,
            pod=name,
            component=labels.get("dask.org/component", ""),
            cluster=labels.get("dask.org/cluster-name", ""),
            workdir=self.workdir / deployment.namespace / name,
        )
        state.workdir.mkdir(parents=True, exist_ok=True)
        owner = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": deployment.name,
            "uid": deployment.metadata.get("uid"),
            "controller": True,
        }
        pod = await Pod(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": deployment.namespace,
                    "labels": labels,
                    "ownerReferences": [owner],
                },
                "spec": template["spec"],
                "status": {"phase": "Pending"},
            },
            namespace=deployment.namespace,
        )
        await pod.create()
        self.pods[(deployment.namespace, deployment.name)] = state
        self.log_files[(state.namespace, name)] = state.workdir / "container.log"

    async def _advance(self, state: PodState, deployment: dict[str, Any]) -> None:
        spec = deployment["spec"]["template"]["spec"]
        if state.phase == "Pending" and state.process is None:
            reason = unschedulable(spec)
            if reason and "FailedScheduling" in state.events:
                return
            if reason:
                await self._event(state, "FailedScheduling", reason, "Warning", "default-scheduler")
                await self._patch_pod(
                    state,
                    {
                        "phase": "Pending",
                        "conditions": [
                            {
                                "type": "PodScheduled",
                                "status": "False",
                                "reason": "Unschedulable",
                                "message": reason,
                            }
                        ],
                    },
                )
                return
            await self._event(
                state,
                "Scheduled",
                f"Successfully assigned {state.namespace}/{state.pod} to {NODE_NAME}",
                source="default-scheduler",
            )
            container = spec["containers"][0]
            await self._event(state, "Pulling", f'Pulling image "{container.get("image")}"')
            await self._event(
                state,
                "Pulled",
                "Container image already present on machine (the shim runs this machine's Python)",
            )
            await self._start(state, spec)
        elif state.process is not None and state.process.returncode is None:
            if not state.ready:
                await self._check_ready(state)
        elif state.process is not None and state.phase != "Failed":
            state.phase = "Failed"
            tail = self._tail(state)
            await self._event(
                state,
                "BackOff",
                f"container exited with {state.process.returncode}: {tail}",
                "Warning",
            )
            await self._patch_pod(
                state,
                {
                    "phase": "Running",
                    "conditions": _conditions(False),
                    "containerStatuses": [
                        {
                            "name": "c",
                            "ready": False,
                            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": tail}},
                        }
                    ],
                },
            )

    async def _start(self, state: PodState, spec: dict[str, Any]) -> None:
        container = spec["containers"][0]
        env = {e["name"]: str(e.get("value", "")) for e in container.get("env") or []}
        mounts = await self._mount_secrets(state, spec, container)
        if state.component == "worker":
            scheduler = self._scheduler_of(state)
            if scheduler is None or not scheduler.ready:
                return  # ContainerCreating until the scheduler Service has an endpoint
            address = env.get("DASK_SCHEDULER_ADDRESS", f"tcp://{state.cluster}-scheduler:8786")
            scheme = address.split("://")[0] if "://" in address else "tcp"
            env["DASK_SCHEDULER_ADDRESS"] = f"{scheme}://{scheduler.address.split('://')[1]}"
        argv = [*container.get("command", []), *container.get("args", [])]
        argv = [_expand(arg, env, mounts) for arg in argv]
        env = {k: _expand(v, env, mounts) for k, v in env.items()}
        argv = self._rewrite(state, argv)
        log = open(state.workdir / "container.log", "ab")  # noqa: SIM115 - owned by the process
        try:
            state.process = await asyncio.create_subprocess_exec(
                *argv,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **env},
                cwd=state.workdir,
            )
        except OSError as error:
            log.write(f"exec {argv[0]}: {error}\n".encode())
            state.process = await asyncio.create_subprocess_exec(sys.executable, "-c", "exit(127)")
        finally:
            log.close()
        state.phase = "Running"
        await self._event(state, "Created", "Created container")
        await self._event(state, "Started", f"Started container: {' '.join(argv[:3])}")
        await self._patch_pod(
            state,
            {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "conditions": _conditions(False),
            },
        )

    def _rewrite(self, state: PodState, argv: list[str]) -> list[str]:
        """Map the image's executables to this venv and bind loopback with free ports."""
        exe = Path(argv[0]).name
        argv[0] = str(BIN / exe) if (BIN / exe).exists() else argv[0]
        if state.component == "scheduler":
            argv = [
                *_drop(argv, SCHEDULER_DROP),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--dashboard-address",
                "127.0.0.1:0",
                "--scheduler-file",
                str(state.workdir / "scheduler.json"),
            ]
        else:
            argv = [
                *_drop(argv, WORKER_DROP),
                "--host",
                "127.0.0.1",
                "--dashboard-address",
                "127.0.0.1:0",
            ]
        return argv

    async def _check_ready(self, state: PodState) -> None:
        if state.component == "scheduler":
            path = state.workdir / "scheduler.json"
            if not path.exists():
                return
            try:
                info = json.loads(path.read_text())
            except ValueError:
                return
            state.address = info["address"]
            state.dashboard_port = info.get("services", {}).get("dashboard")
            await self._publish_service(state)
        state.ready = True
        await self._patch_pod(
            state,
            {
                "phase": "Running",
                "conditions": _conditions(True),
                "containerStatuses": [
                    {"name": "c", "ready": True, "state": {"running": {"startedAt": now()}}}
                ],
            },
        )

    async def _publish_service(self, state: PodState) -> None:
        """Point the scheduler Service at the real ports, with a loopback LoadBalancer ingress."""
        assert state.address is not None
        port = int(state.address.rsplit(":", 1)[1])
        try:
            service = await Service.get(f"{state.cluster}-scheduler", namespace=state.namespace)
        except kr8s.NotFoundError:
            return
        ports = []
        for entry in service.raw["spec"].get("ports", []):
            entry = dict(entry)
            if entry.get("name") == "tcp-comm":
                entry["port"] = port
            elif entry.get("name") == "http-dashboard" and state.dashboard_port:
                entry["port"] = state.dashboard_port
            ports.append(entry)
        await service.patch({"spec": {"ports": ports}})
        await service.patch(
            {"status": {"loadBalancer": {"ingress": [{"ip": "127.0.0.1"}]}}}, subresource="status"
        )

    async def _mount_secrets(
        self, state: PodState, spec: dict[str, Any], container: dict[str, Any]
    ) -> dict[str, str]:
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            local = state.workdir / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True, mode=0o700)
            if "secret" in volume:
                secret = await Secret.get(volume["secret"]["secretName"], namespace=state.namespace)
                for key, value in (secret.raw.get("data") or {}).items():
                    target = local / key
                    target.write_bytes(base64.b64decode(value))
                    target.chmod(0o600)
            mounts[mount["mountPath"].rstrip("/")] = str(local)
        return mounts

    def _scheduler_of(self, state: PodState) -> PodState | None:
        for other in self.pods.values():
            if other.component == "scheduler" and (other.namespace, other.cluster) == (
                state.namespace,
                state.cluster,
            ):
                return other
        return None

    async def _remove(self, state: PodState) -> None:
        await self._kill(state)
        with contextlib.suppress(kr8s.NotFoundError):
            pod = await Pod.get(state.pod, namespace=state.namespace)
            await pod.delete()

    async def _kill(self, state: PodState) -> None:
        process = state.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    # ------------------------------------------------------------------ API writes

    async def _patch_pod(self, state: PodState, status: dict[str, Any]) -> None:
        with contextlib.suppress(kr8s.NotFoundError):
            pod = await Pod.get(state.pod, namespace=state.namespace)
            await pod.patch({"status": status}, subresource="status")

    async def _event(
        self,
        state: PodState,
        reason: str,
        message: str,
        kind: str = "Normal",
        source: str = "kubelet",
    ) -> None:
        if reason in state.events:
            return
        state.events.add(reason)
        event = await Event(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {
                    "name": f"{state.pod}.{uuid.uuid4().hex[:8]}",
                    "namespace": state.namespace,
                },
                "involvedObject": {"kind": "Pod", "name": state.pod, "namespace": state.namespace},
                "reason": reason,
                "message": message,
                "type": kind,
                "count": 1,
                "source": {"component": source},
                "firstTimestamp": now(),
                "lastTimestamp": now(),
            },
            namespace=state.namespace,
        )
        await event.create()

    def _tail(self, state: PodState, lines: int = 5) -> str:
        path = state.workdir / "container.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])


def _conditions(ready: bool) -> list[dict[str, str]]:
    flag = "True" if ready else "False"
    return [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Initialized", "status": "True"},
        {"type": "ContainersReady", "status": flag},
        {"type": "Ready", "status": flag},
    ]


def unschedulable(spec: dict[str, Any]) -> str | None:
    """Why the single emulated node cannot take this pod (kube-scheduler's message), or None."""
    selector = spec.get("nodeSelector") or {}
    if any(NODE_LABELS.get(k) != v for k, v in selector.items()):
        return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    for container in spec.get("containers", []):
        resources = container.get("resources") or {}
        wanted = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        for name, amount in wanted.items():
            if "/" in name and name not in NODE_ALLOCATABLE and str(amount) not in ("0", ""):
                return f"0/1 nodes are available: 1 Insufficient {name}."
    return None


def _drop(argv: list[str], flags: set[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _expand(value: str, env: dict[str, str], mounts: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion, then mounted paths mapped onto the shim's directories."""
    value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value)
    for mount, local in mounts.items():
        value = value.replace(mount + "/", local + "/")
    return value


def service_host(host: str) -> bool:
    """True for a scheduler Service's in-cluster DNS name (``X-scheduler.NS[.svc…]``)."""
    return bool(SERVICE_HOST.match(host))
