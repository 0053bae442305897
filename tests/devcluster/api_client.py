"""A raw HTTP client for the emulator tests: the status code, body and headers exactly as a
client of the API server receives them (the kubernetes client would turn errors into
exceptions and hide the headers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


@dataclass(slots=True)
class Answer:
    status: int
    body: dict[str, Any]
    headers: Any

    def messages(self) -> list[str]:
        """The causes' messages of an error Status (its message when it has none)."""
        causes = (self.body.get("details") or {}).get("causes") or []
        return [c["message"] for c in causes] or [self.body.get("message", "")]


def path_of(resource: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    """The URL path of a resource given as kube_harness names them ("apps/v1/deployments")."""
    *group_version, plural = resource.split("/")
    prefix = "/api/" if len(group_version) == 1 else "/apis/"
    out = f"{prefix}{'/'.join(group_version)}/namespaces/{namespace}/{plural}"
    return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


async def call(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
    **params: str,
) -> Answer:
    """One request to the emulator at `url`."""
    data = body if isinstance(body, str) or body is None else json.dumps(body)
    headers = {"Content-Type": content_type, "User-Agent": "emulator-tests/1.0"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, data=data, headers=headers, params=params) as resp,
    ):
        payload = await resp.json(content_type=None)
        return Answer(resp.status, payload, resp.headers)
