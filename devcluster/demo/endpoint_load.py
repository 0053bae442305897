"""A bounded request load on an InferenceService's ready pods: the traffic of the autoscaling
demo and end-to-end test.

Requests go round-robin to whatever endpoints a callable returns at the moment each request
starts (the ready, not terminating pods — what a Service routes to), so pods that join get
traffic and pods being drained get none new. Each request is a non-streamed completion of
exactly `max_tokens` tokens (`ignore_eos`), so the load is the same whatever the model says.
Every outcome is recorded, failures included: a caller can assert that none failed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

PROMPT = "Write a long story about a fleet of ships that carry memories across the sea."


@dataclass(slots=True, frozen=True)
class RequestResult:
    """One request's outcome; `status` 0 when no HTTP answer came."""

    endpoint: str
    started: float  # time.time()
    finished: float
    status: int
    completion_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        """Answered 200 with a completion."""
        return self.status == 200 and not self.error


@dataclass(slots=True)
class EndpointLoad:
    """Completions against `endpoints()` (base URLs such as http://127.0.0.2:8000)."""

    endpoints: Callable[[], Sequence[str]]
    model: str
    max_tokens: int = 200
    prompt: str = PROMPT
    request_timeout: float = 120.0
    wait_for_endpoint: float = 60.0  # how long a request waits for any pod to be ready
    results: list[RequestResult] = field(default_factory=list)
    in_flight: int = 0
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    async def _endpoint(self) -> str:
        deadline = time.monotonic() + self.wait_for_endpoint
        while True:
            urls = list(self.endpoints())
            if urls:
                return urls[next(self._turn) % len(urls)]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ready endpoint within {self.wait_for_endpoint:g}s")
            await asyncio.sleep(0.1)

    async def request(self, session: aiohttp.ClientSession) -> RequestResult:
        """Send one completion request and record its outcome."""
        endpoint = await self._endpoint()
        body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        started = time.time()
        self.in_flight += 1
        try:
            async with session.post(
                f"{endpoint}/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            ) as response:
                data = await response.json(content_type=None)
                status = response.status
            tokens = int(((data or {}).get("usage") or {}).get("completion_tokens") or 0)
            error = "" if status == 200 else str((data or {}).get("error", data))[:300]
            result = RequestResult(endpoint, started, time.time(), status, tokens, error)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            detail = f"{type(exc).__name__}: {exc}"
            result = RequestResult(endpoint, started, time.time(), 0, error=detail)
        finally:
            self.in_flight -= 1
        self.results.append(result)
        return result

    async def burst(
        self, session: aiohttp.ClientSession, requests: int, concurrency: int
    ) -> list[RequestResult]:
        """`requests` requests, at most `concurrency` at a time; returns their results."""
        todo = iter(range(requests))
        done: list[RequestResult] = []

        async def worker() -> None:
            for _ in todo:
                done.append(await self.request(session))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done

    async def steady(
        self, session: aiohttp.ClientSession, concurrency: int, stop: asyncio.Event
    ) -> list[RequestResult]:
        """Keep `concurrency` requests going until `stop` is set; requests already started
        finish. Returns their results."""
        done: list[RequestResult] = []

        async def worker() -> None:
            while not stop.is_set():
                done.append(await self.request(session))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done
