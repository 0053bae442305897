"""The client side of `kvfleet bench serve`: stream every request of a workload to an
OpenAI-compatible server, at most `concurrency` at once, and time each token as it arrives.

Tokens are counted, not text chunks: with vLLM's `continuous_usage_stats` each chunk's usage
says how many tokens it brought, so a token that decodes to no text yet (half a UTF-8
character, or a random model's id past its tokenizer) is counted where it arrived, and a chunk
of k tokens after a gap gives each of them 1/k of the gap as its inter-token latency. Servers
without per-chunk usage count one token per chunk that carries text.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfleet.runtime.bench.process_cpu import CpuMeter


@dataclass(slots=True)
class RequestRecord:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class RunResult:
    """One pass over the workload; latencies in seconds."""

    concurrency: int
    num_requests: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    errors: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50: float
    itl_p90: float
    itl_p99: float
    e2e_p50: float
    e2e_p90: float
    e2e_p99: float
    first_error: str = ""
    # CPU seconds each part used over the run and the core-seconds the host had
    # (process_cpu.py): {"client", and where the bench spawned the server "server" and "core",
    # "available"}; None where /proc cannot be read.
    cpu_seconds: dict[str, float] | None = None
    # Raw latencies for the plots ("ttft", "itl", "e2e"); not written to the JSON.
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def public(self) -> dict[str, Any]:
        """The JSON-ready summary (percentiles, no raw samples)."""
        out = asdict(self)
        out.pop("samples")
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records: list[RequestRecord], duration: float, concurrency: int) -> RunResult:
    good = [r for r in records if r.ok]
    ttft = [r.ttft for r in good]
    itl = [x for r in good for x in r.itls]
    e2e = [r.e2e for r in good]
    tokens = sum(r.output_tokens for r in good)
    errors = [r for r in records if not r.ok]
    return RunResult(
        concurrency=concurrency,
        num_requests=len(records),
        duration_s=duration,
        requests_per_s=len(good) / duration if duration else 0.0,
        output_tokens_per_s=tokens / duration if duration else 0.0,
        errors=len(errors),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        itl_p50=percentile(itl, 50),
        itl_p90=percentile(itl, 90),
        itl_p99=percentile(itl, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p90=percentile(e2e, 90),
        e2e_p99=percentile(e2e, 99),
        first_error=errors[0].error if errors else "",
        samples={"ttft": ttft, "itl": itl, "e2e": e2e},
    )


async def _one(
    session: Any,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    timeout: float,
    extra: dict[str, Any] | None = None,
) -> RequestRecord:
    import aiohttp

    body = {
        **(extra or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # vLLM's continuous usage: each chunk says how many tokens it brought, so a token that
        # decodes to no text (half a character) is counted where it arrived, not merged into
        # the next gap. Servers without it send no per-chunk usage: each text chunk counts one.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    start = time.perf_counter()
    last = start
    rec = RequestRecord(ok=False)
    tokens = 0  # output tokens received so far
    total = 0
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = str(data["error"].get("message"))
                    return rec
                if not data.get("choices"):  # the closing usage chunk: the count, no token
                    total = (data.get("usage") or {}).get("completion_tokens", tokens)
                    continue
                new = chunk_tokens(data, tokens)
                if not new:
                    continue
                now = time.perf_counter()
                if tokens == 0:
                    rec.ttft = now - start
                else:
                    # A chunk of k tokens after a gap: each token's share of it.
                    rec.itls.extend([(now - last) / new] * new)
                last = now
                tokens += new
    except Exception as exc:  # a benchmark reports failures, it does not stop at the first
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = max(tokens, total)
    rec.ok = True
    return rec


def chunk_tokens(chunk: dict[str, Any], received: int) -> int:
    """How many output tokens a streamed chunk brought: from its usage where the server sends
    one with every chunk (completion_tokens so far), else one per chunk that carries text."""
    usage = chunk.get("usage")
    if usage:
        return max(usage["completion_tokens"] - received, 0)
    return int(any(c.get("text") for c in chunk.get("choices") or []))


async def drive(
    url: str,
    workload: list[tuple[list[int], int]],
    concurrency: int,
    timeout: float,
    extra: dict[str, Any] | list[dict[str, Any]] | None = None,
    processes: dict[str, list[int]] | None = None,
) -> RunResult:
    """Send every request, at most `concurrency` at once, and summarize; `extra`: fields
    added to every request's body (a list: to each request its own). The CPU seconds of this
    process (the client) and of `processes` (role → pids) over the run go in the result."""
    import asyncio
    import os

    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        extras = extra if isinstance(extra, list) else [extra] * len(workload)

        async def limited(prompt: list[int], n: int, more: dict[str, Any] | None) -> RequestRecord:
            async with sem:
                return await _one(session, url, model, prompt, n, timeout, more)

        meter = CpuMeter({"client": [os.getpid()], **(processes or {})})
        meter.start()
        start = time.perf_counter()
        records = await asyncio.gather(
            *(limited(p, n, more) for (p, n), more in zip(workload, extras, strict=True))
        )
        duration = time.perf_counter() - start
        cpu = meter.stop()
    result = summarize(list(records), duration, concurrency)
    result.cpu_seconds = cpu
    return result
