"""The read side of the emulator: get, list (with label and field selectors) and watch (with
resume from a resourceVersion and a bounded duration), over RealisticEmulator's state."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import rendering
from kvfleet.devcluster.apiserver.api_status import ApiError
from kvfleet.devcluster.apiserver.label_selectors import field_matches, selector_matches

Key = tuple[Any, str | None, str]
WATCH_SECONDS = 20.0  # a watch ends like a real one does; clients reconnect with their last RV


class ReadsMixin:
    """Reads for RealisticEmulator (which holds `_objects`, `_rv`, `_log`, `_watchers`)."""

    _objects: Any
    _rv: int
    _log: list[tuple[int, str, dict[str, Any]]]
    _watchers: list[asyncio.Queue[Any]]
    _closing: bool
    resources: Any

    def close_watches(self) -> None:
        """End every open watch now, so the server can stop without waiting for them."""
        self._closing = True
        for q in self._watchers:
            q.put_nowait(None)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object (a copy), or None."""
        key = self._key(kmock.resource(resource), namespace, name)
        return copy.deepcopy(self._objects[key].raw) if self._exists(key) else None

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
            if labels and not selector_matches(labels, raw.get("metadata", {}).get("labels") or {}):
                continue
            if fields and not field_matches(fields, raw):
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
        if labels and not selector_matches(labels, meta.get("labels") or {}):
            return False
        return not (fields and not field_matches(fields, obj))

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

    async def _serve_read(self, request: rendering.Request, res: Any) -> aiohttp.web.StreamResponse:
        """GET: a watch, a list, an object or its scale subresource."""
        if request.params.get("watch") in ("true", "1"):
            return await self._watch(request, res)
        if request.name is None:
            info = self._info(res)
            kind = (info.kind or res.plural.capitalize()) + "List"
            api_version = f"{res.group}/{res.version}" if res.group else res.version
            return aiohttp.web.json_response(
                {
                    "apiVersion": api_version,
                    "kind": kind,
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": self._matching(request, res),
                }
            )
        key = self._key(res, request.namespace, request.name)
        if not self._exists(key):
            raise ApiError(404, "NotFound", f'{res.plural} "{request.name}" not found')
        current = copy.deepcopy(self._objects[key].raw)
        return aiohttp.web.json_response(
            self._scale(current) if request.subresource == "scale" else current
        )
