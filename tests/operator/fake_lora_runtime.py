"""A stand-in for `kvfleet serve --enable-lora` in the operator's LoRA tests: an aiohttp app on
one loopback address (a pod IP) that answers the runtime's LoRA contract — GET /v1/models (the
base model and each adapter with its root and parent), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (OpenAI-shaped 400s naming the adapter and the reason, 404 for an
unknown name), the API key on every /v1 path, and /metrics with one
`kvfleet:lora_adapter_loaded` series per adapter.

What an adapter's files would say is given as `files`: lora_path -> its rank; a path not there
has no adapter_config.json."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvfleet import contract


@dataclass
class FakeLoraRuntime:
    ip: str
    base_model: str = "chat"
    api_key: str | None = None
    max_lora_rank: int = 16
    enable_lora: bool = True
    files: dict[str, int] = field(default_factory=dict)  # lora_path -> rank
    adapters: dict[str, str] = field(default_factory=dict)  # name -> lora_path, as loaded
    requests: list[tuple[str, str, Any, str | None]] = field(default_factory=list)
    fail_with: int | None = None  # answer every LoRA POST with this status (a 500: a bug)
    # Loads still under way from an earlier request (a long download): they finish as the next
    # load of that name arrives, which the runtime's lock then refuses as already loaded.
    loading: dict[str, str] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_get(contract.HEALTH_PATH, lambda _: web.Response(text="ok"))
        app.router.add_get(contract.METRICS_PATH, self._metrics)
        app.router.add_get(contract.MODELS_PATH, self._models)
        app.router.add_post(contract.LOAD_LORA_PATH, self._load)
        app.router.add_post(contract.UNLOAD_LORA_PATH, self._unload)
        return app

    def posts(self, path: str) -> list[dict[str, Any]]:
        """The bodies POSTed to `path`, in order."""
        return [body for method, p, body, _ in self.requests if method == "POST" and p == path]

    @web.middleware
    async def _record(self, request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        body = await request.json() if request.method == "POST" else None
        self.requests.append(
            (request.method, request.path, body, request.headers.get("Authorization"))
        )
        wants_key = request.path.startswith("/v1/") and self.api_key is not None
        if wants_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "invalid API key", "invalid_api_key")
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": self.base_model, "object": "model", "root": self.base_model, "parent": None}]
        data += [
            {"id": name, "object": "model", "root": path, "parent": self.base_model}
            for name, path in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        if self.fail_with is not None:
            return _error(self.fail_with, "internal error", "internal_error")
        if name in self.loading:
            self.adapters[name] = self.loading.pop(name)
        if not self.enable_lora:
            return _error(400, "LoRA is not enabled: start the server with --enable-lora")
        if name in self.adapters:
            return _error(400, f"adapter {name!r} is already loaded")
        if path not in self.files:
            return _error(400, f"adapter {name!r}: no adapter_config.json in {path}")
        if self.files[path] > self.max_lora_rank:
            return _error(
                400,
                f"adapter {name!r}: its rank {self.files[path]} is above --max-lora-rank "
                f"{self.max_lora_rank}",
            )
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if self.fail_with is not None:
            return _error(self.fail_with, "internal error", "internal_error")
        if self.adapters.pop(name, None) is None:
            return _error(404, f"adapter {name!r} is not loaded", "model_not_found")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _metrics(self, request: web.Request) -> web.Response:
        label = f'{{{contract.MODEL_NAME_LABEL}="{self.base_model}"}}'
        lines = [
            f"{contract.NUM_REQUESTS_WAITING}{label} 0.0",
            f"{contract.NUM_REQUESTS_RUNNING}{label} 0.0",
            f"{contract.KV_CACHE_USAGE_PERC}{label} 0.0",
        ]
        lines += [
            f'{contract.LORA_ADAPTER_LOADED}{{{contract.LORA_NAME_LABEL}="{name}"}} 1.0'
            for name in self.adapters
        ]
        return web.Response(text="\n".join(lines) + "\n")


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}
    return web.json_response(body, status=status)


@contextlib.asynccontextmanager
async def serving(port: int, *runtimes: FakeLoraRuntime) -> AsyncIterator[None]:
    """Serve each fake on its own address, all on `port`, as pods are."""
    runners = []
    try:
        for runtime in runtimes:
            runner = web.AppRunner(runtime.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, runtime.ip, port).start()
            runners.append(runner)
        yield
    finally:
        for runner in runners:
            await runner.cleanup()
