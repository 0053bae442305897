"""Server-side apply requests for the emulator: decode the apply configuration, check what the
API server checks (a field manager, the object's name and kind), then let
server_side_apply.py merge it and the emulator's create or write path store it."""

from __future__ import annotations

from typing import Any

import yaml
from kmock._internal import rendering
from kvfleet.devcluster.apiserver.admission import Admission, WriteOptions
from kvfleet.devcluster.apiserver.api_status import ApiError
from kvfleet.devcluster.apiserver.server_side_apply import apply


def request_manager(request: rendering.Request) -> str:
    """The `fieldManager` parameter, else the User-Agent's product (as the API server does)."""
    named = request.params.get("fieldManager")
    return named or request.headers.get("User-Agent", "unknown").split("/")[0][:128]


class ApplyMixin:
    """`PATCH` with `application/apply-patch+yaml`, for RealisticEmulator."""

    admission: Admission
    _objects: Any

    def _apply(
        self,
        res: Any,
        namespace: str | None,
        name: str,
        request: rendering.Request,
        subresource: str | None,
        opts: WriteOptions,
    ) -> tuple[dict[str, Any], int]:
        """Server-side apply: (object, HTTP status)."""
        if not request.params.get("fieldManager"):
            raise ApiError(
                422,
                "Invalid",
                'PatchOptions.meta.k8s.io "" is invalid: fieldManager: '
                "Required value: is required for apply patch",
            )
        try:
            applied = yaml.safe_load(request.text or "{}")
        except yaml.YAMLError as exc:
            raise ApiError(400, "BadRequest", f"error decoding YAML: {exc}") from exc
        if (
            not isinstance(applied, dict)
            or not applied.get("apiVersion")
            or not applied.get("kind")
        ):
            raise ApiError(400, "BadRequest", "invalid object: apiVersion and kind must be set")
        sent_name = (applied.get("metadata") or {}).get("name")
        if sent_name != name:
            raise ApiError(
                400,
                "BadRequest",
                f"the name of the object ({sent_name}) does not match the name on the URL ({name})",
            )
        probe = dict(applied)
        self._typed(res, probe)
        if (probe["apiVersion"], probe["kind"]) != (applied["apiVersion"], applied["kind"]):
            raise ApiError(
                400,
                "BadRequest",
                f"{applied['kind']} {applied['apiVersion']} does "
                f"not match the resource {res.plural}",
            )
        applied = self.admission.prepare_applied(applied, opts)
        key = self._key(res, namespace, name)
        live = self._objects[key].raw if self._exists(key) else None
        if live is None and subresource:
            raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
        new = apply(
            live,
            applied,
            opts.manager,
            force=opts.force,
            subresource=subresource,
            shape=self.admission.shape(applied),
            has_status=self._has_status(res),
        )
        if live is None:
            return self._create(res, namespace, new, opts, applied=True), 201
        return self._write(res, key, new, subresource, opts, applied=True), 200
