"""A kmock Kubernetes API emulator with its known gaps worked around (infra.md §4e).

Added over ``kmock.KubernetesEmulator``: metadata defaulting (namespace, uid, resourceVersion,
creationTimestamp), label and field selectors on list and watch, cascade deletion through
``ownerReferences`` (the garbage collector), ``GET /version/``, the dask CRDs declared, pod logs
served from the kubelet shim's files, SelfSubjectAccessReview answers, and faults a test can turn
on through ``POST /__faults``: ``{"no_crds": true}`` (404 for kubernetes.dask.org) and
``{"forbidden": ["daskclusters"]}`` (403 for those resources).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums

DASK_GROUP = "kubernetes.dask.org"
DASK_RESOURCES = {
    "daskclusters": "DaskCluster",
    "daskworkergroups": "DaskWorkerGroup",
    "daskjobs": "DaskJob",
    "daskautoscalers": "DaskAutoscaler",
}
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}

Selector = Callable[[dict[str, Any]], bool]


def _dig(obj: dict[str, Any], dotted: str) -> Any:
    value: Any = obj
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _label_term(term: str) -> Selector:
    term = term.strip()
    if match := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\((.*)\)", term):
        key, op, values = match[1], match[2], {v.strip() for v in match[3].split(",")}
        if op == "in":
            return lambda o: (_dig(o, "metadata.labels") or {}).get(key) in values
        return lambda o: (_dig(o, "metadata.labels") or {}).get(key) not in values
    if match := re.fullmatch(r"([\w./-]+)\s*(!=|==|=)\s*([\w./-]*)", term):
        key, op, value = match[1], match[2], match[3]
        if op == "!=":
            return lambda o: (_dig(o, "metadata.labels") or {}).get(key) != value
        return lambda o: (_dig(o, "metadata.labels") or {}).get(key) == value
    if term.startswith("!"):
        return lambda o: term[1:] not in (_dig(o, "metadata.labels") or {})
    return lambda o: term in (_dig(o, "metadata.labels") or {})


def _split_terms(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [t for t in [*terms, current] if t.strip()]


def _field_term(term: str) -> Selector:
    match = re.fullmatch(r"([\w.]+)\s*(!=|==|=)\s*(.*)", term.strip())
    if not match:
        raise ValueError(f"unsupported field selector {term!r}")
    path, op, value = match[1], match[2], match[3]
    if op == "!=":
        return lambda o: str(_dig(o, path) or "") != value
    return lambda o: str(_dig(o, path) or "") == value


def selector(params: dict[str, str]) -> Selector:
    """The predicate of a request's labelSelector and fieldSelector."""
    checks = [_label_term(t) for t in _split_terms(params.get("labelSelector", ""))]
    checks += [_field_term(t) for t in _split_terms(params.get("fieldSelector", ""))]
    return lambda obj: all(check(obj) for check in checks)


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.json_response(body, status=code)


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """The emulator served to kr8s, kopf and the kubelet shim."""

    faults: dict[str, Any] = attrs.field(factory=dict)
    log_files: dict[tuple[str, str], Path] = attrs.field(factory=dict)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        for plural, kind in DASK_RESOURCES.items():
            self.resources[f"{DASK_GROUP}/v1/{plural}"] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=True,
                verbs=VERBS,
                subresources={"status", "scale"},
            )
        self["get /version/"] << {"major": "1", "minor": "30", "gitVersion": "v1.30.0"}

    # ------------------------------------------------------------------ request pipeline

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        if request.url.path == "/__faults":
            self.faults = dict(request.data or {})
            return aiohttp.web.json_response(self.faults)
        resource = request.resource
        if resource is None:
            if request.url.path in ("/api/", "/apis/"):  # kr8s asks with a trailing slash
                serve = self._serve_api if request.url.path == "/api/" else self._serve_apis
                return aiohttp.web.json_response(await serve(request))
            return await super()._handle(request)
        if self.faults.get("no_crds") and resource.group == DASK_GROUP:
            return _status(404, "NotFound", "the server could not find the requested resource")
        if resource.plural == "selfsubjectaccessreviews":
            return self._access_review(request.data or {})
        if resource.plural in set(self.faults.get("forbidden", ())):
            message = (
                f"{resource.plural}.{resource.group or 'core'} is forbidden: User "
                f'"clusterkit-test" cannot {request.method.value.lower()} resource '
                f'"{resource.plural}" in API group "{resource.group}"'
            )
            return _status(403, "Forbidden", message)
        if resource.plural == "pods" and request.subresource == "log":
            path = self.log_files.get((request.namespace, request.name))
            text = path.read_text(errors="replace") if path and path.exists() else ""
            return aiohttp.web.Response(text=text)
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            self._default_metadata(request)
        elif request.action == enums.action.UPDATE:
            self._bump_version(request.data)
        owner_uid, key = None, (resource, request.namespace, request.name)
        named = request.action in (enums.action.DELETE, enums.action.UPDATE) and request.name
        if named and key in self.objects and not self.objects[key].deleted:
            owner_uid = _dig(self.objects[key].raw, "metadata.uid")
        response = await super()._handle(request)
        # dependents go once the owner is really gone: a finalizer (the operator's) holds it
        # until its controller removes the finalizer, as the real garbage collector waits
        if owner_uid and self.objects[key].deleted:
            await self._collect_garbage({owner_uid})
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            await self._reap_if_orphan(resource, request.data.get("metadata", {}))
        return response

    async def _reap_if_orphan(self, resource: Any, meta: dict[str, Any]) -> None:
        """Created with owners that are all gone already (a late controller): collect it."""
        refs = meta.get("ownerReferences") or []
        if not refs:
            return
        async with self._lock:
            live = {_dig(o.raw, "metadata.uid") for o in self.objects.values() if not o.deleted}
            if any(ref.get("uid") in live for ref in refs):
                return
            key = (resource, meta.get("namespace"), meta.get("name"))
            if key not in self.objects or self.objects[key].deleted:
                return
            raw = self.objects[key].raw
            self.objects[key].delete()
            await self._buses[resource].put({"type": "DELETED", "object": raw})
        await self._collect_garbage({meta.get("uid")})

    def _default_metadata(self, request: Any) -> None:
        meta = request.data.setdefault("metadata", {})
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._versions))
        meta.setdefault("generation", 1)
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta.setdefault("creationTimestamp", now)

    def _bump_version(self, patch: Any) -> None:
        version = str(next(self._versions))
        if isinstance(patch, dict):
            patch.setdefault("metadata", {})
            if isinstance(patch["metadata"], dict):
                patch["metadata"]["resourceVersion"] = version
        elif isinstance(patch, list):
            patch.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})

    def _access_review(self, review: dict[str, Any]) -> aiohttp.web.Response:
        attributes = _dig(review, "spec.resourceAttributes") or {}
        allowed = attributes.get("resource") not in set(self.faults.get("forbidden", ()))
        reason = "" if allowed else "forbidden by the emulator's fault settings"
        body = dict(review, status={"allowed": allowed, "reason": reason})
        return aiohttp.web.json_response(body, status=201)

    async def _collect_garbage(self, owners: set[str]) -> None:
        """Delete, transitively, every object owned by a deleted one (what kube-controller does)."""
        while owners:
            doomed: list[tuple[Any, dict[str, Any]]] = []
            async with self._lock:
                for key, obj in list(self.objects.items()):
                    if obj.deleted:
                        continue
                    refs = _dig(obj.raw, "metadata.ownerReferences") or []
                    if any(ref.get("uid") in owners for ref in refs):
                        raw = obj.raw
                        obj.delete()
                        doomed.append((key[0], raw))
                for resource, raw in doomed:
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
            owners = {_dig(raw, "metadata.uid") for _, raw in doomed} - {None}

    # ------------------------------------------------------------------ selectors

    async def _serve_list(self, request: Any) -> Any:
        payload = await super()._serve_list(request)
        keep = selector(request.params)
        payload["items"] = [obj for obj in payload["items"] if keep(obj)]
        payload.setdefault("kind", "List")
        payload.setdefault("apiVersion", "v1")
        return payload

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        keep = selector(request.params)
        async for event in super()._serve_watch(request):
            obj = event.get("object") if isinstance(event, dict) else None
            if isinstance(obj, dict) and not keep(obj):
                continue
            yield event


def kubeconfig(port: int) -> str:
    """A kubeconfig pointing at the emulator on 127.0.0.1."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "clusterkit-test", "user": {"token": "emulator"}}],
            "contexts": [
                {
                    "name": "kmock",
                    "context": {
                        "cluster": "kmock",
                        "user": "clusterkit-test",
                        "namespace": "default",
                    },
                }
            ],
            "current-context": "kmock",
        },
        indent=1,
    )
