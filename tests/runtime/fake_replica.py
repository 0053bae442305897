"""A stand-in for `kvfleet serve` in the router's tests: an aiohttp app on 127.0.0.1 that
answers /health, /metrics (the load and the LoRA adapters it is told to report), /v1/models,
/tokenize, /detokenize and both generation endpoints, naming itself in every answer, and that
can be told to break off a stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from kvfleet import contract

STREAM_CHUNKS = 3


@dataclass
class FakeReplica:
    name: str
    health_status: int = 200
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = 16
    adapters: set[str] = field(default_factory=set)  # LoRA adapters it reports loaded
    generate_status: int = 200  # a non-200 answers every generation request with that status
    break_stream_after: int | None = None  # chunks sent before the connection is cut
    hold: asyncio.Event | None = None  # a stream waits for it after its first chunk
    bodies: list[Any] = field(default_factory=list)
    cancelled: int = 0  # generation handlers cancelled (their client went away)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(contract.HEALTH_PATH, self._health)
        app.router.add_get(contract.METRICS_PATH, self._metrics)
        app.router.add_get(contract.MODELS_PATH, self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/tokenize", self._tokenizer)
        app.router.add_post("/detokenize", self._tokenizer)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": self.name}, status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        label = f'{{{contract.MODEL_NAME_LABEL}="fake"}}'
        lines = [
            f"{contract.NUM_REQUESTS_WAITING}{label} {self.waiting}",
            f"{contract.NUM_REQUESTS_RUNNING}{label} {self.running}",
            f"{contract.KV_CACHE_USAGE_PERC}{label} {self.kv_usage}",
        ]
        if self.block_size:
            lines.append(
                f'{contract.CACHE_CONFIG_INFO}{{block_size="{self.block_size}",'
                f'num_gpu_blocks="100"}} 1.0'
            )
        lines += [
            f'{contract.LORA_ADAPTER_LOADED}{{{contract.LORA_NAME_LABEL}="{name}"}} 1.0'
            for name in sorted(self.adapters)
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def _tokenizer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if request.path == "/tokenize":
            return web.json_response({"served_by": self.name, "count": 2, "tokens": [7, 9]})
        return web.json_response({"served_by": self.name, "prompt": "hi"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "owner": self.name}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.generate_status != 200:
            return web.json_response(
                {"error": {"message": self.name, "type": "x", "param": None, "code": None}},
                status=self.generate_status,
            )
        if not body.get("stream"):
            return web.json_response({"served_by": self.name, "choices": [{"text": self.name}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(STREAM_CHUNKS):
                if i == self.break_stream_after:
                    # Half an event, then the connection is cut: a replica dying mid-write.
                    await resp.write(b'data: {"choices": [{"te')
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                chunk = {"served_by": self.name, "choices": [{"text": f"{self.name}-{i}"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0 and self.hold is not None:
                    await self.hold.wait()
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return resp


@contextlib.asynccontextmanager
async def running(*replicas: FakeReplica) -> AsyncIterator[list[str]]:
    """Serve each fake on its own 127.0.0.1 port; yields their URLs."""
    servers = [TestServer(r.app()) for r in replicas]
    try:
        for r, s in zip(replicas, servers, strict=True):
            await s.start_server()
            r.url = str(s.make_url("")).rstrip("/")
        yield [r.url for r in replicas]
    finally:
        for s in servers:
            await s.close()
