"""kmock's KubernetesEmulator, made to behave like a real API server where the operator cares.

The plain emulator never sets resourceVersion (kopf then runs no handler), merges /status into
the whole object, has no generation, 409s, PUT, selectors or garbage collection, and stores
whatever it is sent. This subclass serves every request for a declared resource itself
(discovery stays with kmock), so it never rewrites kmock's request objects (kmock matches
reactions by request identity). State lives in kmock's `objects` array, so tests can read
`emulator.objects['apps/v1/deployments', ns, name]`.

Every write passes admission.py (CRD schema, defaults, pruning and CEL rules; built-in schemas
at the chart's minimum Kubernetes, canonical quantities) and keeps `metadata.managedFields`;
`PATCH` with `application/apply-patch+yaml` is server-side apply (server_side_apply.py).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import pathlib
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import apps, parsing, rendering
from kvfleet.devcluster.apiserver.admission import Admission, WriteOptions
from kvfleet.devcluster.apiserver.api_status import ApiError
from kvfleet.devcluster.apiserver.builtin_schemas import chart_minimum_kubernetes, schema_version
from kvfleet.devcluster.apiserver.crd_schema import CrdSchema
from kvfleet.devcluster.apiserver.emulator_apply import ApplyMixin, request_manager
from kvfleet.devcluster.apiserver.emulator_reads import ReadsMixin
from kvfleet.devcluster.apiserver.emulator_resources import CORE, crd_resource
from kvfleet.devcluster.apiserver.patches import PatchTestFailed, json_patch, merge_patch
from kvfleet.devcluster.apiserver.server_side_apply import record_update
from kvfleet.devcluster.source_checkout import CRD_DIR

Key = tuple[Any, str | None, str]
CRD_FILES = sorted(CRD_DIR.glob("*.yaml"))
_KMOCK_PARSE_PATH = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock's path parsing, plus the core `namespaces` resource itself: kmock takes
    `/api/v1/namespaces[/NAME]` for a namespace prefix and fails (HTTP 500) on it, so kopf,
    which lists and watches namespaces when it serves only some, could not start."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        name = parts[3] if len(parts) > 3 else None
        return parsing.ParsedPath(
            "", "v1", "namespaces", None, name, parts[4] if len(parts) > 4 else None
        )
    return _KMOCK_PARSE_PATH(path)


parsing.parse_path = _parse_path  # kmock's request parsing calls it through the module


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    """What `generation` tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class RealisticEmulator(ReadsMixin, ApplyMixin, kmock.KubernetesEmulator):
    """A Kubernetes API emulator with the server semantics kopf and the operator depend on.

    Adds: uid, creationTimestamp, resourceVersion (global counter), generation bumped on spec
    changes only, status-subresource semantics, 409 on create-existing and stale
    resourceVersion, PUT, merge/JSON patch, server-side apply with managedFields, admission
    (validation, defaulting, pruning, canonical quantities), dryRun, label and field
    selectors, list kind/apiVersion, watch resume from a resourceVersion, finalizers, and
    ownerReference garbage collection.

    `kubernetes_version`: the Kubernetes whose built-in schemas apply (default: the chart's
    minimum, or the oldest schema kubernetes-validate ships above it).
    """

    kubernetes_version: str = attrs.field(
        factory=lambda: schema_version(chart_minimum_kubernetes())
    )
    crd_files: list[pathlib.Path] = attrs.field(factory=lambda: list(CRD_FILES))
    admission: Admission = attrs.field(init=False)
    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, str, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _watchers: list[asyncio.Queue[Any]] = attrs.field(factory=list, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    # The HTTP status of each answer it served, by kmock's request id: whether a server-side
    # apply created its object (201) is what decides if RBAC had to allow `create` too.
    answers: dict[int, int] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.admission = Admission(self.kubernetes_version, self.crd_files)

    def declare_core(self) -> None:
        """Declare the built-in resources the operator uses and every CRD's resource."""
        for path, info in CORE.items():
            self.resources[path] = info
        for crd in self.admission.crds.values():
            path, info = crd_resource(crd)
            self.resources[path] = info

    def install_crd(self, path: pathlib.Path) -> None:
        """Install a CRD while serving, as a cluster admin would (e.g. GIE's InferencePool):
        its resource is discoverable and validated from then on."""
        crd = CrdSchema.load(path)
        self.admission.crds[(f"{crd.group}/{crd.version['name']}", crd.kind)] = crd
        resource, info = crd_resource(crd)
        self.resources[resource] = info

    # --- helpers for tests: act as a human or as another controller would -------------------
    def mutate(
        self, resource: str, namespace: str, name: str, change: Any, manager: str = "kubectl-edit"
    ) -> dict[str, Any]:
        """Apply `change(obj)` (it edits the dict in place) as a full write, status included;
        admission applies (ApiError if the server would refuse it)."""
        res = kmock.resource(resource)
        key = self._key(res, namespace, name)
        old = self._objects[key].raw
        obj = copy.deepcopy(old)
        change(obj)
        return self._write(res, key, obj, "everything", WriteOptions(manager))

    def remove(self, resource: str, namespace: str, name: str) -> None:
        """Delete as `kubectl delete` would (finalizers honoured, dependents collected)."""
        self._delete(kmock.resource(resource), namespace, name)

    def create_object(
        self,
        resource: str,
        obj: dict[str, Any],
        manager: str = "kubectl-create",
        *,
        validate: bool = True,
    ) -> dict[str, Any]:
        """Create as `kubectl create` would (admission applies: ApiError if refused).
        `validate=False` stores it as a server with an older CRD, without today's rules, let
        it in: what the operator's own spec checks exist for."""
        res = kmock.resource(resource)
        if not validate:
            with self.admission.disabled():
                return self._create(
                    res, obj["metadata"].get("namespace"), copy.deepcopy(obj), WriteOptions(manager)
                )
        return self._create(
            res, obj["metadata"].get("namespace"), copy.deepcopy(obj), WriteOptions(manager)
        )

    # --- writes -----------------------------------------------------------------------------
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

    def _has_status(self, res: Any) -> bool:
        info = self._info(res)
        return info is not None and "status" in info.subresources

    def _typed(self, res: Any, obj: dict[str, Any]) -> None:
        obj.setdefault("apiVersion", f"{res.group}/{res.version}" if res.group else res.version)
        info = self._info(res)
        if info is not None and info.kind:
            obj.setdefault("kind", info.kind)

    def _create(
        self,
        res: Any,
        namespace: str | None,
        obj: dict[str, Any],
        opts: WriteOptions,
        applied: bool = False,
    ) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = self._key(res, meta.get("namespace"), meta.get("name", ""))
        if self._exists(key):
            raise ApiError(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        meta.pop("resourceVersion", None)
        self._typed(res, obj)
        if self._has_status(res):
            obj.pop("status", None)  # the status subresource ignores status on create
        self.admission.admit(obj, None, opts)
        if not applied:
            record_update(
                None, obj, opts.manager, None, self.admission.shape(obj), self._has_status(res)
            )
        if opts.dry_run:
            return obj
        stored = self._store(res, key, obj, "ADDED")
        owners = {r.get("uid") for r in meta.get("ownerReferences") or []}
        if owners and not owners & self._live_uids():
            # The garbage collector deletes dependents whose owners are gone (shortly after).
            asyncio.get_running_loop().call_soon(self._collect_orphan, res, key)
        return stored

    def _write(
        self,
        res: Any,
        key: Key,
        new: dict[str, Any],
        subresource: str | None,
        opts: WriteOptions,
        applied: bool = False,
    ) -> dict[str, Any]:
        """Store `new` as written to `subresource` (None: the main resource; "everything": a
        test helper's write of spec and status at once)."""
        old = self._objects[key].raw
        sent_rv = new.get("metadata", {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                "the object has been modified; please apply your "
                "changes to the latest version and try again",
            )
        if subresource == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            if applied:
                merged["metadata"]["managedFields"] = new["metadata"].get("managedFields", [])
        else:
            merged = copy.deepcopy(new)
            merged.setdefault("metadata", {})
            if self._has_status(res) and subresource != "everything":
                # The main endpoint cannot change status.
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
        self._typed(res, merged)
        self.admission.admit(merged, old, opts)
        if not applied:
            tracked = None if subresource == "everything" else subresource
            record_update(
                old,
                merged,
                opts.manager,
                tracked,
                self.admission.shape(merged),
                self._has_status(res),
            )
        if merged == old:
            return old  # a no-op write changes nothing, not even the resourceVersion
        if _spec_part(merged) != _spec_part(old):
            merged["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        if opts.dry_run:
            return merged
        return self._store(res, key, merged, "MODIFIED")

    def _delete(self, res: Any, namespace: str | None, name: str) -> dict[str, Any]:
        key = self._key(res, namespace, name)
        if not self._exists(key):
            raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
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

    def _live_uids(self) -> set[str]:
        return {o.raw["metadata"].get("uid") for o in self._objects.values() if not o.deleted}

    def _collect_orphan(self, res: Any, key: Key) -> None:
        if self._exists(key):
            self._delete(res, key[1], key[2])

    # --- serving ----------------------------------------------------------------------------
    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is not None and res.plural is not None and self._info(res) is None and res.group:
            # A resource of an API group the cluster does not serve (a CRD not installed): the
            # API server's 404, not kmock's own reaction.
            return ApiError(
                404, "NotFound", "the server could not find the requested resource"
            ).response()
        if res is None or res.plural is None or self._info(res) is None:
            # Discovery and anything undeclared: kmock's own reactions (skipping the plain
            # emulator's state-keeping, which would double-store our writes).
            return await apps.RawHandler._handle(self, request)
        try:
            response = await self._serve(request, res)
        except ApiError as err:
            response = err.response()
        self.answers[request.id] = response.status
        return response

    async def _serve(self, request: rendering.Request, res: Any) -> aiohttp.web.StreamResponse:
        method, name, ns, sub = (
            request.method.value,
            request.name,
            request.namespace,
            request.subresource,
        )
        if method == "GET":
            return await self._serve_read(request, res)
        opts = WriteOptions(
            manager=request_manager(request),
            field_validation=request.params.get("fieldValidation"),
            force=request.params.get("force") in ("true", "1"),
            dry_run=bool(request.params.get("dryRun")),
        )

        def answer(obj: dict[str, Any], status: int = 200) -> aiohttp.web.Response:
            headers = [("Warning", f'299 - "{w}"') for w in opts.warnings]
            response = aiohttp.web.json_response(obj, status=status)
            for header, value in headers:
                response.headers.add(header, value)
            return response

        if method == "POST" and name is None:
            return answer(self._create(res, ns, request.data or {}, opts), 201)
        if method == "DELETE":
            return answer(self._delete(res, ns, name))
        ctype = request.headers.get("Content-Type", "").split(";")[0]
        if method == "PATCH" and ctype == "application/apply-patch+yaml":
            return answer(*self._apply(res, ns, name, request, sub, opts))
        key = self._key(res, ns, name)
        if not self._exists(key):
            raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
        current = copy.deepcopy(self._objects[key].raw)
        if sub == "scale":
            body = request.data or {}
            if method == "PATCH":
                body = merge_patch(self._scale(current), body)
            current.setdefault("spec", {})["replicas"] = body.get("spec", {}).get("replicas", 0)
            # A resourceVersion in the Scale sent is a precondition on the object, as for the
            # object itself: a stale one is a 409 (the activator's 0 → 1 relies on it).
            sent = request.data if isinstance(request.data, dict) else {}
            if rv := (sent.get("metadata") or {}).get("resourceVersion"):
                current["metadata"]["resourceVersion"] = rv
            return answer(self._scale(self._write(res, key, current, "scale", opts)))
        if method == "PUT":
            new = request.data or {}
        elif method == "PATCH":
            try:
                if ctype == "application/json-patch+json":
                    new = json_patch(current, request.data or [])
                else:  # merge and strategic-merge patches: merged as RFC 7386 (lists replaced)
                    new = merge_patch(current, request.data or {})
            except PatchTestFailed as exc:
                raise ApiError(422, "Invalid", str(exc)) from exc
            # Only a resourceVersion the client sent is a precondition (JSON patches use `test`).
            sent = request.data if isinstance(request.data, dict) else {}
            if "resourceVersion" not in (sent.get("metadata") or {}):
                new.setdefault("metadata", {}).pop("resourceVersion", None)
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")
        return answer(self._write(res, key, new, sub, opts))
