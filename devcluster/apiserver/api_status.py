"""The API server's error answers: a `Status` object with a code, a reason and, for invalid
objects, one cause per field, as clients (kubectl, the kubernetes client, kopf) read them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp.web


@dataclass(frozen=True, slots=True)
class Cause:
    """One reason a write was refused: `field` is the path (spec.replicas), `reason` the
    apimachinery cause type (FieldValueInvalid, FieldValueRequired, FieldValueNotSupported...)."""

    field: str
    reason: str
    message: str

    def text(self) -> str:
        """How the API server prints it in the Status message."""
        return f"{self.field}: {self.message}" if self.field else self.message

    def as_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.text(), "field": self.field}


def quote(value: Any) -> str:
    """A value as Go's field errors print it: strings quoted, objects by their type name."""
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return json.dumps(value)


class ApiError(Exception):
    """An error answer: raised anywhere while serving a request, sent back as a Status."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        causes: list[Cause] | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.causes = causes or []
        self.details = details or {}

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        details = dict(self.details)
        if self.causes:
            details["causes"] = [c.as_dict() for c in self.causes]
        if details:
            body["details"] = details
        return body

    def response(self) -> aiohttp.web.Response:
        return aiohttp.web.json_response(self.body(), status=self.code)


def invalid(kind: str, group: str, name: str, causes: list[Cause]) -> ApiError:
    """422 Invalid, worded as the API server words it:
    `InferenceService.kvfleet.dev "chat" is invalid: [spec.replicas: ..., ...]`."""
    qualified = f"{kind}.{group}" if group else kind
    texts = [c.text() for c in causes]
    listed = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{qualified} "{name}" is invalid: {listed}',
        causes,
        {"name": name, "group": group, "kind": kind},
    )
