"""The LoRA adapters a server answers to by name: `--lora-modules` at start, and vLLM's
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` while it runs (behind the API key,
as every /v1 path), so a platform adds a fine-tune to a live replica without restarting it.

A request's `model` picks the adapter; the server numbers adapters (an id is never reused, so a
name unloaded and loaded again from other files never meets the old one's cached prefixes) and
the engine core reads and checks the files: what it refuses is a 400 naming the adapter and
why. Sources: a local PEFT folder, or `hf://org/repo[@revision]` (or `org/repo`), fetched into
the same Hugging Face cache as the base model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from kvfleet.runtime.server.api_error import APIError
from kvfleet.runtime.server.fields import get_field, type_name

from kvfleet import contract

if TYPE_CHECKING:
    from kvfleet.runtime.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

HF_SCHEME = "hf://"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(slots=True, frozen=True)
class LoraModule:
    lora_id: int
    name: str
    source: str  # as given: a folder, hf://org/repo[@rev] or org/repo
    path: str  # the local folder it was read from


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """--lora-modules' (name, source) pairs: `name=path` or vLLM's JSON form
    `{"name": ..., "path": ...}`; ValueError naming the bad entry."""
    pairs = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                name, source = entry["name"], entry["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f'lora_modules: {value!r} is not {{"name": ..., "path": ...}}'
                ) from None
        else:
            name, sep, source = value.partition("=")
            if not sep:
                raise ValueError(f"lora_modules: {value!r} is not name=path")
        if not isinstance(name, str) or not NAME.match(name) or not source:
            raise ValueError(f"lora_modules: {value!r} needs a name (letters, digits, ._:/-)")
        pairs.append((name, source))
    return pairs


def local_folder(source: str, hf_token: str | None) -> str:
    """The folder `source` names, fetched from the Hub first when it is a repo (blocking:
    run it off the event loop). ModelLoadError when the Hub refuses or cannot be reached."""
    from kvfleet.runtime.models.hub import download_model, is_hub_id

    repo = source.removeprefix(HF_SCHEME) if source.startswith(HF_SCHEME) else None
    if repo is None and is_hub_id(source):
        repo = source
    if repo is None:
        return source
    repo, _, revision = repo.partition("@")
    return str(download_model(repo, revision or None, hf_token))


class LoraAdapters:
    """Name → adapter, for one server; `enabled` is --enable-lora."""

    def __init__(
        self, engine: AsyncEngine, base_name: str, enabled: bool, hf_token: str | None = None
    ) -> None:
        self.engine = engine
        self.base_name = base_name
        self.enabled = enabled
        self.hf_token = hf_token
        self.modules: dict[str, LoraModule] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load at a time: names are checked, then taken

    def lora_id(self, model: str | None) -> int:
        """The adapter a request's `model` names (0: the base model); 404 for another name."""
        if model is None or model == self.base_name:
            return 0
        module = self.modules.get(model)
        if module is None:
            served = ", ".join(repr(n) for n in [self.base_name, *self.modules])
            raise APIError(
                404,
                f"model: {model!r} is not served here; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return module.lora_id

    def names(self) -> list[str]:
        return list(self.modules)

    def cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters: each with its base model as `parent`."""
        return [
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "kvfleet",
                "root": m.source,
                "parent": self.base_name,
            }
            for m in self.modules.values()
        ]

    async def load(self, name: str, source: str) -> LoraModule:
        """Fetch, check and load adapter `name`; APIError 400 saying why it cannot be."""
        from kvfleet.runtime.models.errors import ModelLoadError
        from kvfleet.runtime.models.lora import LoraError

        if not self.enabled:
            raise APIError(
                400,
                "lora_name: this server runs without LoRA; start it with --enable-lora",
                param="lora_name",
            )
        if not NAME.match(name) or name == self.base_name:
            raise APIError(
                400,
                f"lora_name: {name!r} must be 1-128 letters, digits or ._:/- and differ from "
                f"the base model's name",
                param="lora_name",
            )
        async with self._lock:
            if name in self.modules:
                raise APIError(
                    400,
                    f"lora_name: adapter {name!r} is already loaded (unload it first)",
                    param="lora_name",
                )
            try:
                path = await asyncio.to_thread(local_folder, source, self.hf_token)
                lora_id = next(self._ids)
                await self.engine.add_lora(lora_id, name, path)
            except (ModelLoadError, LoraError) as exc:
                message = str(exc).removeprefix("model: ")
                raise APIError(400, f"lora_path: {message}", param="lora_path") from None
            module = LoraModule(lora_id, name, source, path)
            self.modules[name] = module
        log.info("LoRA adapter %r loaded from %s", name, source)
        return module

    def unload(self, name: str) -> None:
        """Forget adapter `name` (running requests finish with it); 404 if it is unknown."""
        module = self.modules.pop(name, None)
        if module is None:
            raise APIError(
                404,
                f"lora_name: no adapter {name!r} is loaded",
                param="lora_name",
                code="model_not_found",
            )
        self.engine.remove_lora(module.lora_id)
        log.info("LoRA adapter %r unloaded", name)

    # --- routes ------------------------------------------------------------------------------
    def add_routes(self, app: web.Application, read_json: Callable[..., Awaitable[Any]]) -> None:
        """vLLM's two endpoints; `read_json` reads a body within the server's limits."""

        async def load(request: web.Request) -> web.Response:
            body = await read_json(request)
            name, source = _field(body, "lora_name"), _field(body, "lora_path")
            await self.load(name, source)
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

        async def unload(request: web.Request) -> web.Response:
            name = _field(await read_json(request), "lora_name")
            self.unload(name)
            return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

        app.router.add_post(contract.LOAD_LORA_PATH, load)
        app.router.add_post(contract.UNLOAD_LORA_PATH, unload)


def _field(body: Any, name: str) -> str:
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {type_name(body)}")
    value = get_field(body, name, str)
    if not value:
        raise APIError(400, f"{name}: required, a non-empty string", param=name)
    return value
