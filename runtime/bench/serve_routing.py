"""`kvfleet bench serve --replicas N`: prefix-aware routing against random placement.

For each policy (`prefix`, then `random`) the command starts N fresh `kvfleet serve` replicas
and a `kvfleet router --policy P` in front of them, all on 127.0.0.1, drives the same
workload through the router, and reads the replicas' own prefix-cache counters
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, in tokens, and
`vllm:num_preemptions_total`) before and after: the hit rate is what the fleet's caches
actually served, not what the router guessed.
Fresh replicas per policy, so neither run inherits the other's cache.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvfleet.runtime.bench.serve_spawn import healthy_process

from kvfleet.contract import NUM_PREEMPTIONS, PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES

ROUTING_POLICIES = ("prefix", "random")


async def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        (x.name, frozenset(x.labels.items())): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }


def _total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


async def replica_counters(urls: list[str]) -> list[tuple[float, float, float]]:
    """(prefix-cache hits, queries, preemptions) per replica; hits and queries in tokens."""
    out = []
    for url in urls:
        samples = await _scrape(url)
        out.append(
            (
                _total(samples, f"{PREFIX_CACHE_HITS}_total"),
                _total(samples, f"{PREFIX_CACHE_QUERIES}_total"),
                _total(samples, f"{NUM_PREEMPTIONS}_total"),
            )
        )
    return out


@contextlib.asynccontextmanager
async def spawned_router(urls: list[str], policy: str, seed: int) -> AsyncIterator[str]:
    """`kvfleet router --policy POLICY` over `urls` on a free loopback port, healthy; yields
    its URL and stops it on exit."""

    def argv(port: int) -> list[str]:
        argv = [sys.executable, "-m", "kvfleet.runtime.cli", "router", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--policy", policy, "--seed", str(seed)]
        argv += ["--log-level", "warning"]
        for u in urls:
            argv += ["--upstream", u]
        return argv

    async with healthy_process(argv, "the router", 60, 0.2) as (url, _):
        yield url


async def run_routing(
    args: argparse.Namespace,
    workload: list[tuple[list[int], int]],
    spawned_server: Callable[[argparse.Namespace, list[str]], Any],
    drive: Callable[..., Any],
) -> dict[str, Any]:
    """Each policy in ROUTING_POLICIES over `args.replicas` fresh replicas: the run's
    latencies, the replicas' prefix hit rate, and how the router picked."""
    results: dict[str, Any] = {}
    for policy in ROUTING_POLICIES:
        async with contextlib.AsyncExitStack() as stack:
            urls = [
                (await stack.enter_async_context(spawned_server(args, []))).url
                for _ in range(args.replicas)
            ]
            router = await stack.enter_async_context(
                spawned_router(urls, policy, args.workload_seed)
            )
            print(
                f"  {args.replicas} replicas + router --policy {policy}, driving "
                f"{len(workload)} requests at concurrency {args.concurrency}",
                file=sys.stderr,
            )
            before = await replica_counters(urls)
            run = await drive(router, workload, args.concurrency, args.timeout)
            after = await replica_counters(urls)
            picks = await _scrape(router)
        hits, queries, preemptions = (
            [a[i] - b[i] for a, b in zip(after, before, strict=True)] for i in range(3)
        )
        results[policy] = {
            **run.public(),
            "prefix_hit_rate": sum(hits) / sum(queries) if sum(queries) else 0.0,
            "replica_prefix_hits": hits,
            "replica_prefix_queries": queries,
            # A preempted request looks its prompt up again when it is recomputed: its tokens
            # count twice in hits and queries. How often that happened, and the prefill work
            # the run really did, say whether the hit rate is about placement or about memory.
            "preemptions": sum(preemptions),
            "prefill_tokens_computed": sum(queries) - sum(hits),
            "picks": {
                dict(labels)["reason"]: v
                for (n, labels), v in picks.items()
                if n == "kvfleet_router_picks_total" and v
            },
        }
    on, off = results["prefix"], results["random"]
    return {
        "replicas": args.replicas,
        "num_prefixes": args.num_prefixes,
        "routing": results,
        "prefix_hit_rate_prefix": on["prefix_hit_rate"],
        "prefix_hit_rate_random": off["prefix_hit_rate"],
        "hit_rate_ratio": (
            on["prefix_hit_rate"] / off["prefix_hit_rate"] if off["prefix_hit_rate"] else None
        ),
        "ttft_p50_prefix": on["ttft_p50"],
        "ttft_p50_random": off["ttft_p50"],
        "ttft_ratio": off["ttft_p50"] / on["ttft_p50"] if on["ttft_p50"] else None,
        "errors": on["errors"] + off["errors"],
    }
