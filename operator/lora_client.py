"""The runtime's LoRA endpoints as the operator calls them on one pod: which adapters it has
(GET /v1/models), load one, unload one. The contract is vLLM's (kvfleet/contract.py names the
paths); every /v1 path wants the API key as a Bearer token when the pods have one.

Answers are sorted by what the caller can do about them: `Answer.refused` is the runtime's 400
on a load (the adapter itself is wrong for this model or server: a rank above --max-lora-rank,
modules the model lacks, missing files), which trying again will not fix; anything else that
is not a success (no answer, a 401, a 5xx) is worth another try later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvfleet import contract

LIST_TIMEOUT_SECONDS = 5.0
# A load of an hf:// adapter includes its download; large adapters (rank 64 on a 70B model is
# over a gigabyte) take minutes on a slow link.
LOAD_TIMEOUT_SECONDS = 600.0
UNLOAD_TIMEOUT_SECONDS = 30.0
MESSAGE_CHARS = 500  # of a runtime's error text, enough for its reason


class LoraApiError(RuntimeError):
    """The pod's adapters could not be read (no answer, an error status, a body not a model
    list); the message names the URL and the cause."""


@dataclass(slots=True, frozen=True)
class Answer:
    """What a load or unload came to: `ok`, or why not (`refused`: the runtime's 400)."""

    ok: bool
    refused: bool = False
    message: str = ""


def pod_url(ip: str, port: int) -> str:
    """The pod's base URL (IPv6 pod IPs in brackets)."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(status: int, text: str) -> str:
    """The runtime's own message from an OpenAI-shaped error body, else the body's text."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        message = body["error"].get("message")
        if isinstance(message, str) and message:
            return message[:MESSAGE_CHARS]
    return (text.strip() or f"HTTP {status}")[:MESSAGE_CHARS]


def adapters_in(models: Any) -> dict[str, str]:
    """The adapters in a /v1/models body, name -> root (the path they were loaded from): the
    entries with a parent model; the base model has none."""
    if not isinstance(models, Mapping) or not isinstance(models.get("data"), list):
        raise ValueError("not a model list (no data array)")
    return {
        m["id"]: str(m.get("root") or "")
        for m in models["data"]
        if isinstance(m, Mapping) and isinstance(m.get("id"), str) and m.get("parent")
    }


async def list_adapters(
    session: aiohttp.ClientSession, base: str, api_key: str | None
) -> dict[str, str]:
    """The adapters loaded on the pod at `base`, name -> root; LoraApiError when unreadable."""
    url = base + contract.MODELS_PATH
    try:
        async with session.get(
            url,
            headers=_headers(api_key),
            timeout=aiohttp.ClientTimeout(total=LIST_TIMEOUT_SECONDS),
        ) as response:
            text = await response.text()
            if response.status != 200:
                message = error_message(response.status, text) + _key_hint(response.status)
                raise LoraApiError(f"GET {url}: HTTP {response.status}: {message}")
        return adapters_in(json.loads(text))
    except TimeoutError:
        raise LoraApiError(f"GET {url}: no answer within {LIST_TIMEOUT_SECONDS:g}s") from None
    except (aiohttp.ClientError, ValueError, UnicodeDecodeError) as exc:
        raise LoraApiError(f"GET {url}: {exc or type(exc).__name__}") from None


async def load_adapter(
    session: aiohttp.ClientSession, base: str, api_key: str | None, name: str, path: str
) -> Answer:
    """POST the load of adapter `name` from `path` (an hf:// URI or a folder in the pod)."""
    body = {"lora_name": name, "lora_path": path}
    return await _post(session, base + contract.LOAD_LORA_PATH, api_key, body, LOAD_TIMEOUT_SECONDS)


async def unload_adapter(
    session: aiohttp.ClientSession, base: str, api_key: str | None, name: str
) -> Answer:
    """POST the unload of adapter `name`; one the pod does not have (404) is gone: ok."""
    answer = await _post(
        session,
        base + contract.UNLOAD_LORA_PATH,
        api_key,
        {"lora_name": name},
        UNLOAD_TIMEOUT_SECONDS,
        gone_ok=True,
    )
    # An unload is never "refused" for good: the name stays loaded, so it is tried again.
    return Answer(answer.ok, refused=False, message=answer.message)


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    api_key: str | None,
    body: Mapping[str, str],
    timeout: float,
    gone_ok: bool = False,
) -> Answer:
    try:
        async with session.post(
            url,
            json=dict(body),
            headers=_headers(api_key),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            text = await response.text()
            status = response.status
    except TimeoutError:
        return Answer(False, message=f"POST {url}: no answer within {timeout:g}s")
    except (aiohttp.ClientError, UnicodeDecodeError) as exc:
        return Answer(False, message=f"POST {url}: {exc or type(exc).__name__}")
    if status == 200 or (gone_ok and status == 404):
        return Answer(True)
    message = error_message(status, text) + _key_hint(status)
    if status == 400:
        return Answer(False, refused=True, message=message)
    return Answer(False, message=f"POST {url}: HTTP {status}: {message}")


def _key_hint(status: int) -> str:
    # The operator reads the key from the Secret at each pass; a pod reads it once, at its start.
    if status != 401:
        return ""
    return " (the pod's API key is not the one in spec.apiKeySecretRef's Secret: changed since the pod started?)"
