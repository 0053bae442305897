"""kmock's KubernetesEmulator, made to behave like a real API server where the operator cares.

The plain emulator never sets resourceVersion (kopf then runs no handler), merges /status into
the whole object, has no generation, 409s, PUT, selectors or garbage collection. This subclass
serves every request for a declared resource itself (discovery stays with kmock), so it never
rewrites kmock's request objects (kmock matches reactions by request identity). State lives in
kmock's `objects` array, so tests can read `emulator.objects['apps/v1/deployments', ns, name]`.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import apps, rendering

Key = tuple[Any, str | None, str]

CORE = {
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment", namespaced=True, subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    ),
    "v1/services": kmock.ResourceInfo(
        kind="Service", namespaced=True, subresources={"status"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    ),
    "v1/pods": kmock.ResourceInfo(
        kind="Pod", namespaced=True, subresources={"status"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    ),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(
        kind="PodDisruptionBudget", namespaced=True, subresources={"status"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    ),
    # kopf's backbone: it waits for these to be discoverable before it starts watching.
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"},
    ),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs={"get", "list", "watch"}),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"create", "list", "get"}),
    # Read by the kubelet simulator for secretKeyRef env (the operator never reads Secrets).
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True, verbs={"create", "get", "list"}),
    "kvfleet.dev/v1alpha1/inferenceservices": kmock.ResourceInfo(
        kind="InferenceService", namespaced=True, subresources={"status", "scale"},
        shortnames={"infsvc"}, verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    ),
}  # fmt: skip

WATCH_SECONDS = 20.0  # a watch ends like a real one does; clients reconnect with their last RV


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "code": code, "reason": reason, "message": message}  # fmt: skip
    return aiohttp.web.json_response(body, status=code)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge recursively, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class PatchTestFailed(Exception):
    """A JSON-patch `test` op did not hold (the server answers 422)."""


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/remove/replace/test, enough for kopf's finalizer and annotation writes."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1] if parts else ""
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise PatchTestFailed(
                    f"test failed at {op['path']}: {current!r} != {op.get('value')!r}"
                )
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                idx = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(idx, op["value"])
                else:
                    parent[idx] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
    return doc


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    """What `generation` tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality, inequality, set (in/notin) and existence requirements, comma-separated."""
    for req in re.split(r",(?![^()]*\))", selector):
        req = req.strip()
        if not req:
            continue
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", req):
            values = {v.strip() for v in m[3].split(",")}
            inside = labels.get(m[1]) in values
            if inside != (m[2] == "in"):
                return False
        elif "!=" in req:
            k, v = req.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in req:
            k, v = req.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif req.startswith("!"):
            if req[1:] in labels:
                return False
        elif req not in labels:
            return False
    return True


def _field_matches(selector: str, obj: dict[str, Any]) -> bool:
    for req in filter(None, (r.strip() for r in selector.split(","))):
        negate = "!=" in req
        key, value = req.split("!=" if negate else "=", 1)
        node: Any = obj
        for part in key.lstrip("=").split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if (str(node) == value) == negate:
            return False
    return True


@attrs.define(kw_only=True)
class RealisticEmulator(kmock.KubernetesEmulator):
    """A Kubernetes API emulator with the server semantics kopf and the operator depend on.

    Adds: uid, creationTimestamp, resourceVersion (global counter), generation bumped on spec
    changes only, status-subresource semantics, 409 on create-existing and stale
    resourceVersion, PUT, merge/JSON patch, label and field selectors, list kind/apiVersion,
    watch resume from a resourceVersion, finalizers, and ownerReference garbage collection.
    """

    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, str, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _watchers: list[asyncio.Queue[Any]] = attrs.field(factory=list, init=False)
    _closing: bool = attrs.field(default=False, init=False)

    def declare_core(self) -> None:
        """Declare the resources the operator uses (discovery needs them)."""
        for path, info in CORE.items():
            self.resources[path] = info

    def close_watches(self) -> None:
        """End every open watch now, so the server can stop without waiting for them."""
        self._closing = True
        for q in self._watchers:
            q.put_nowait(None)

    # --- helpers for tests: act as a human or as another controller would -------------------
    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object (a copy), or None."""
        key = self._key(kmock.resource(resource), namespace, name)
        return copy.deepcopy(self._objects[key].raw) if self._exists(key) else None

    def mutate(self, resource: str, namespace: str, name: str, change: Any) -> dict[str, Any]:
        """Apply `change(obj)` (it edits the dict in place) as a full write, status included."""
        res = kmock.resource(resource)
        key = self._key(res, namespace, name)
        old = self._objects[key].raw
        obj = copy.deepcopy(old)
        change(obj)
        if _spec_part(obj) != _spec_part(old):
            obj["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        return self._store(res, key, obj, "MODIFIED")

    def remove(self, resource: str, namespace: str, name: str) -> None:
        """Delete as `kubectl delete` would (finalizers honoured, dependents collected)."""
        self._delete(kmock.resource(resource), namespace, name)

    def create_object(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create as `kubectl create` would."""
        res = kmock.resource(resource)
        return self._create(res, obj["metadata"].get("namespace"), copy.deepcopy(obj))

    # --- internals --------------------------------------------------------------------------
    def _key(self, res: Any, namespace: str | None, name: str) -> Key:
        return (res, namespace, name)

    def _exists(self, key: Key) -> bool:
        return key in self._objects and not self._objects[key].deleted

    def _info(self, res: Any) -> Any:
        for declared in self.resources:
            if (declared.group, declared.version, declared.plural) == (
                res.group,
                res.version,
                res.plural,
            ):
                return self.resources[declared]
        return None

    def _emit(self, res: Any, type_: str, obj: dict[str, Any]) -> None:
        event = {"type": type_, "object": copy.deepcopy(obj)}
        rv = int(obj["metadata"]["resourceVersion"])
        self._log.append((rv, str(res), event))
        for q in list(self._watchers):
            q.put_nowait((str(res), event))

    def _bump(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    def _store(self, res: Any, key: Key, obj: dict[str, Any], type_: str) -> dict[str, Any]:
        self._bump(obj)
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        self._emit(res, type_, obj)
        if (
            type_ == "MODIFIED"
            and obj["metadata"].get("deletionTimestamp")
            and not obj["metadata"].get("finalizers")
        ):
            self._purge(res, key)
        return obj

    def _create(self, res: Any, namespace: str | None, obj: dict[str, Any]) -> dict[str, Any]:
        info = self._info(res)
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = self._key(res, meta.get("namespace"), meta["name"])
        if self._exists(key):
            raise _Reply(
                _status(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
            )
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        meta.pop("resourceVersion", None)
        obj.setdefault("apiVersion", f"{res.group}/{res.version}" if res.group else res.version)
        if info is not None and info.kind:
            obj.setdefault("kind", info.kind)
        if info is not None and "status" in info.subresources:
            obj.pop("status", None)  # the status subresource ignores status on create
        stored = self._store(res, key, obj, "ADDED")
        owners = {r.get("uid") for r in meta.get("ownerReferences") or []}
        if owners and not owners & self._live_uids():
            # The garbage collector deletes dependents whose owners are gone (shortly after).
            asyncio.get_running_loop().call_soon(self._collect_orphan, res, key)
        return stored

    def _live_uids(self) -> set[str]:
        return {o.raw["metadata"].get("uid") for o in self._objects.values() if not o.deleted}

    def _collect_orphan(self, res: Any, key: Key) -> None:
        if self._exists(key):
            self._delete(res, key[1], key[2])

    def _write(
        self, res: Any, key: Key, new: dict[str, Any], subresource: str | None
    ) -> dict[str, Any]:
        old = self._objects[key].raw
        info = self._info(res)
        has_status = info is not None and "status" in info.subresources
        sent_rv = new.get("metadata", {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise _Reply(
                _status(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version",
                )
            )
        if subresource == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
        else:
            merged = copy.deepcopy(new)
            if has_status:  # the main endpoint cannot change status
                if "status" in old:
                    merged["status"] = copy.deepcopy(old["status"])
                else:
                    merged.pop("status", None)
            # Immutable server-owned metadata.
            for field in (
                "uid",
                "creationTimestamp",
                "generation",
                "deletionTimestamp",
                "name",
                "namespace",
            ):
                if field in old["metadata"]:
                    merged["metadata"][field] = old["metadata"][field]
        merged["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if merged == old:
            return old  # a no-op write changes nothing, not even the resourceVersion
        if _spec_part(merged) != _spec_part(old):
            merged["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        return self._store(res, key, merged, "MODIFIED")

    def _delete(self, res: Any, namespace: str | None, name: str) -> dict[str, Any]:
        key = self._key(res, namespace, name)
        if not self._exists(key):
            raise _Reply(_status(404, "NotFound", f'{res.plural} "{name}" not found'))
        obj = copy.deepcopy(self._objects[key].raw)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = _now()
                return self._store(res, key, obj, "MODIFIED")
            return obj
        return self._purge(res, key)

    def _purge(self, res: Any, key: Key) -> dict[str, Any]:
        obj = copy.deepcopy(self._objects[key].raw)
        self._objects[key].delete()
        self._bump(obj)
        self._emit(res, "DELETED", obj)
        uid = obj["metadata"]["uid"]
        # Garbage collection: dependents whose ownerReferences name the deleted uid.
        for (dep_res, dep_ns, dep_name), dep in list(self._objects.items()):
            if dep.deleted:
                continue
            refs = dep.raw.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                self._delete(dep_res, dep_ns, dep_name)
        return obj

    def _matching(self, request: rendering.Request, res: Any) -> list[dict[str, Any]]:
        labels = request.params.get("labelSelector", "")
        fields = request.params.get("fieldSelector", "")
        out = []
        for (r, ns, _), obj in self._objects.items():
            if r != res or obj.deleted:
                continue
            raw = obj.raw
            if request.namespace is not None and ns != request.namespace:
                continue
            if labels and not _selector_matches(
                labels, raw.get("metadata", {}).get("labels") or {}
            ):
                continue
            if fields and not _field_matches(fields, raw):
                continue
            out.append(copy.deepcopy(raw))
        return out

    def _event_matches(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        labels = request.params.get("labelSelector", "")
        fields = request.params.get("fieldSelector", "")
        if labels and not _selector_matches(labels, meta.get("labels") or {}):
            return False
        return not (fields and not _field_matches(fields, obj))

    async def _watch(self, request: rendering.Request, res: Any) -> aiohttp.web.StreamResponse:
        raw_request = request._raw_request
        assert raw_request is not None
        queue: asyncio.Queue[Any] = asyncio.Queue()
        since = request.params.get("resourceVersion", "")
        if since and since != "0":
            backlog = [ev for rv, r, ev in self._log if rv > int(since) and r == str(res)]
        else:
            backlog = [{"type": "ADDED", "object": o} for o in self._matching(request, res)]
        self._watchers.append(queue)
        response = aiohttp.web.StreamResponse(
            status=200, headers={"Content-Type": "application/json"}
        )
        await response.prepare(raw_request)
        timeout = min(float(request.params.get("timeoutSeconds") or WATCH_SECONDS), WATCH_SECONDS)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            for event in backlog:
                if self._event_matches(request, event["object"]):
                    await response.write(json.dumps(event).encode() + b"\n")
            while not self._closing:
                try:
                    item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    break
                if item is None:
                    break
                r, event = item
                if r == str(res) and self._event_matches(request, event["object"]):
                    await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(queue)
        return response

    def _scale(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta
            },
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {
                "replicas": (obj.get("status") or {}).get("replicas", 0),
                "selector": (obj.get("status") or {}).get("selector", ""),
            },
        }

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or self._info(res) is None:
            # Discovery and anything undeclared: kmock's own reactions (skipping the plain
            # emulator's state-keeping, which would double-store our writes).
            return await apps.RawHandler._handle(self, request)
        try:
            return await self._serve(request, res)
        except _Reply as reply:
            return reply.response

    async def _serve(self, request: rendering.Request, res: Any) -> aiohttp.web.StreamResponse:
        method, name, ns, sub = (
            request.method.value,
            request.name,
            request.namespace,
            request.subresource,
        )
        info = self._info(res)
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, res)
        if method == "GET" and name is None:
            items = self._matching(request, res)
            kind = (info.kind or res.plural.capitalize()) + "List"
            api_version = f"{res.group}/{res.version}" if res.group else res.version
            return aiohttp.web.json_response(
                {
                    "apiVersion": api_version,
                    "kind": kind,
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": items,
                }
            )
        if method == "POST" and name is None:
            obj = self._create(res, ns, request.data or {})
            return aiohttp.web.json_response(obj, status=201)
        key = self._key(res, ns, name)
        if method == "DELETE":
            return aiohttp.web.json_response(self._delete(res, ns, name))
        if not self._exists(key):
            return _status(404, "NotFound", f'{res.plural} "{name}" not found')
        current = copy.deepcopy(self._objects[key].raw)
        if method == "GET":
            return aiohttp.web.json_response(self._scale(current) if sub == "scale" else current)
        if sub == "scale":
            body = request.data or {}
            if method == "PATCH":
                body = merge_patch(self._scale(current), body)
            current.setdefault("spec", {})["replicas"] = body.get("spec", {}).get("replicas", 0)
            return aiohttp.web.json_response(self._scale(self._write(res, key, current, None)))
        if method == "PUT":
            new = request.data or {}
        elif method == "PATCH":
            ctype = request.headers.get("Content-Type", "").split(";")[0]
            try:
                if ctype == "application/json-patch+json":
                    new = json_patch(current, request.data or [])
                else:  # merge and strategic-merge patches: merged as RFC 7386 (lists replaced)
                    new = merge_patch(current, request.data or {})
            except PatchTestFailed as exc:
                return _status(422, "Invalid", str(exc))
            # Only a resourceVersion the client sent is a precondition (JSON patches use `test`).
            sent = request.data if isinstance(request.data, dict) else {}
            if "resourceVersion" not in (sent.get("metadata") or {}):
                new.setdefault("metadata", {}).pop("resourceVersion", None)
        else:
            return _status(405, "MethodNotAllowed", f"{method} is not supported")
        return aiohttp.web.json_response(self._write(res, key, new, sub))


class _Reply(Exception):
    """Carries an early HTTP answer (an error Status) out of the state-changing helpers."""

    def __init__(self, response: aiohttp.web.Response) -> None:
        super().__init__(response.status)
        self.response = response
