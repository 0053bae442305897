"""`kvfleet router`: an OpenAI-compatible front for several `kvfleet serve` replicas (or any
server speaking the Gateway API Inference Extension's model-server protocol: vLLM's metric
names) that sends each request where its prompt's prefix is cached, unless that replica is
overloaded or down. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from urllib.parse import urlsplit

from kvfleet import contract

log = logging.getLogger("kvfleet.router")


def register(sub: argparse._SubParsersAction) -> None:
    from kvfleet.runtime.router.policy import POLICIES, PolicySettings
    from kvfleet.runtime.router.settings import RouterSettings

    d, dp = RouterSettings(), PolicySettings()
    p = sub.add_parser(
        "router",
        help="route OpenAI requests over replicas by prompt prefix and load",
        description=__doc__,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=contract.RUNTIME_PORT, help="port to listen on")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://10.0.0.5:8000 (repeat for each replica); or "
        "find them with --discover-selector",
    )
    k = p.add_argument_group(
        "Kubernetes discovery",
        "the replicas are the Ready pods matching a label selector, listed from the API server "
        "every --discover-interval seconds (in a pod: its service account, which needs "
        "list on pods in that namespace)",
    )
    k.add_argument(
        "--discover-selector",
        metavar="SELECTOR",
        help="label selector of the replicas' pods, e.g. app.kubernetes.io/instance=chat",
    )
    k.add_argument(
        "--discover-namespace",
        metavar="NS",
        help="their namespace (default: the router pod's own, from its service account)",
    )
    k.add_argument(
        "--discover-port",
        type=int,
        default=contract.RUNTIME_PORT,
        help="the port the replicas serve on",
    )
    k.add_argument(
        "--discover-interval", type=float, default=1.0, help="seconds between two listings"
    )
    k.add_argument(
        "--discover-api-server",
        metavar="URL",
        help="the API server (default: in a pod, https://$KUBERNETES_SERVICE_HOST:"
        "$KUBERNETES_SERVICE_PORT with the service account's CA and token)",
    )
    a = p.add_argument_group(
        "scale from zero",
        "with --activate-deployment, a request arriving while no replica is ready is held and "
        "the Deployment is scaled from 0 to 1 through its scale subresource (the service "
        "account needs get and patch on deployments/scale); the namespace and API server are "
        "--discover-namespace and --discover-api-server's",
    )
    a.add_argument(
        "--activate-deployment",
        metavar="NAME",
        help="the replicas' Deployment, woken from zero replicas by a request",
    )
    a.add_argument(
        "--activator-queue-limit",
        type=int,
        default=100,
        help="requests held at a time while no replica is ready; more get 503 at once",
    )
    a.add_argument(
        "--cold-start-timeout",
        type=float,
        default=300.0,
        help="seconds a held request waits for a ready replica before a 503 (replaces "
        "--wait-for-replica)",
    )
    p.add_argument(
        "--policy",
        default=dp.policy,
        choices=POLICIES,
        help="prefix: prefix affinity with load fallback; least-loaded, random: baselines",
    )
    p.add_argument(
        "--prefix-blocks",
        type=int,
        default=d.prefix_blocks,
        help="KV blocks of the prompt (the replicas' block size, ~4 characters a token) whose "
        "hash picks the replica",
    )
    p.add_argument(
        "--placement-table-size",
        type=int,
        default=d.placement_table_size,
        help="prefix keys whose replica the router remembers (least recently used forgotten "
        "first); a new key goes to the replica with the fewest keys; 0: rendezvous hashing only",
    )
    p.add_argument(
        "--max-waiting",
        type=float,
        default=dp.max_waiting,
        help="a replica with more requests queued is overloaded",
    )
    p.add_argument(
        "--max-kv-usage",
        type=float,
        default=dp.max_kv_usage,
        help="a replica whose KV cache is this full (0-1) is overloaded",
    )
    p.add_argument(
        "--load-factor",
        type=float,
        default=dp.load_factor,
        help="a replica with more than this times the mean load is overloaded (>= 1)",
    )
    p.add_argument("--scrape-interval", type=float, default=d.scrape_interval, help="seconds")
    p.add_argument("--scrape-timeout", type=float, default=d.scrape_timeout, help="seconds")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout, help="seconds")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="seconds a whole request (its stream included) may take upstream",
    )
    p.add_argument(
        "--wait-for-replica",
        type=float,
        default=d.wait_for_replica,
        help="seconds a request waits for a healthy replica before a 503",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=d.max_attempts,
        help="replicas tried for a request that a replica refused (connection refused or 503)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body accepted (413 beyond)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' of every client, as kvfleet serve does "
        f"(default: ${contract.API_KEY_ENV}, the replicas' own variable; an empty key is an "
        "error); /health and /metrics stay open. A request without it is refused before it "
        "is routed or wakes a Deployment",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity",
    )
    p.set_defaults(func=run)


def upstream_url(value: str) -> str:
    """A replica's base URL, checked: http(s)://host[:port], no path."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream: give http://host:port, got {value!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"upstream: give a base URL without a path, got {value!r}")
    return f"{parts.scheme}://{parts.netloc}"


def discovery_from_args(args: argparse.Namespace) -> object | None:
    """DiscoverySettings from the --discover-* flags (None without --discover-selector);
    ValueError names a bad one."""
    from kvfleet.runtime.router.discovery import SERVICE_ACCOUNT_DIR, DiscoverySettings

    if not args.discover_selector:
        return None
    if args.upstream:
        raise ValueError("upstream: give --upstream or --discover-selector, not both")
    namespace = args.discover_namespace
    if not namespace:
        ns_file = SERVICE_ACCOUNT_DIR / "namespace"
        if not ns_file.is_file():
            raise ValueError(
                "discover-namespace: required outside a pod (no service account namespace file)"
            )
        namespace = ns_file.read_text().strip()
    if not 1 <= args.discover_port <= 65535:
        raise ValueError(f"discover-port: must be in [1, 65535], got {args.discover_port}")
    if not args.discover_interval > 0:
        raise ValueError(f"discover-interval: must be > 0 seconds, got {args.discover_interval}")
    api = args.discover_api_server
    if api is not None:
        parts = urlsplit(api)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"discover-api-server: give http(s)://host:port, got {api!r}")
    return DiscoverySettings(
        selector=args.discover_selector,
        namespace=namespace,
        port=args.discover_port,
        api_server=api,
        interval=args.discover_interval,
    )


def activator_from_args(args: argparse.Namespace) -> object | None:
    """ActivatorSettings from the scale-from-zero flags (None without --activate-deployment);
    ValueError names a bad one."""
    from kvfleet.runtime.router.activator import ActivatorSettings
    from kvfleet.runtime.router.discovery import SERVICE_ACCOUNT_DIR

    if not args.activate_deployment:
        return None
    if args.activator_queue_limit < 1:
        raise ValueError(
            f"activator_queue_limit: must be >= 1 request, got {args.activator_queue_limit}"
        )
    if not args.cold_start_timeout > 0:
        raise ValueError(f"cold_start_timeout: must be > 0 seconds, got {args.cold_start_timeout}")
    namespace = args.discover_namespace
    if not namespace:
        ns_file = SERVICE_ACCOUNT_DIR / "namespace"
        if not ns_file.is_file():
            raise ValueError(
                "discover-namespace: required with --activate-deployment outside a pod "
                "(no service account namespace file)"
            )
        namespace = ns_file.read_text().strip()
    return ActivatorSettings(
        deployment=args.activate_deployment,
        namespace=namespace,
        queue_limit=args.activator_queue_limit,
        timeout=args.cold_start_timeout,
        api_server=args.discover_api_server,
    )


def settings_from_args(args: argparse.Namespace) -> tuple[list[str], object]:
    """(upstream URLs, RouterSettings) from the flags and $KVFLEET_API_KEY; ValueError names a
    bad one."""
    from kvfleet.runtime.router.api_key import api_key_from
    from kvfleet.runtime.router.policy import PolicySettings
    from kvfleet.runtime.router.settings import RouterSettings

    urls = [upstream_url(u) for u in args.upstream]
    if not urls and not args.discover_selector:
        raise ValueError("upstream: give at least one --upstream URL, or --discover-selector")
    if len(set(urls)) != len(urls):
        raise ValueError(f"upstream: each replica once, got {urls}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port: must be in [0, 65535], got {args.port}")
    for name in ("prefix_blocks", "max_attempts", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
    for name in ("scrape_interval", "scrape_timeout", "connect_timeout", "request_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"{name}: must be > 0 seconds, got {getattr(args, name)}")
    if args.placement_table_size < 0:
        raise ValueError(
            f"placement_table_size: must be >= 0 keys, got {args.placement_table_size}"
        )
    if args.wait_for_replica < 0:
        raise ValueError(f"wait_for_replica: must be >= 0 seconds, got {args.wait_for_replica}")
    policy = PolicySettings(args.policy, args.max_waiting, args.max_kv_usage, args.load_factor)
    settings = RouterSettings(
        policy=policy,
        prefix_blocks=args.prefix_blocks,
        placement_table_size=args.placement_table_size,
        scrape_interval=args.scrape_interval,
        scrape_timeout=args.scrape_timeout,
        connect_timeout=args.connect_timeout,
        request_timeout=args.request_timeout,
        wait_for_replica=args.wait_for_replica,
        max_attempts=args.max_attempts,
        max_body_bytes=args.max_body_bytes,
        seed=args.seed,
        api_key=api_key_from(args.api_key, os.environ),
    )
    return urls, settings


def run(args: argparse.Namespace) -> int:
    import asyncio

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        urls, settings = settings_from_args(args)
        discovery = discovery_from_args(args)
        activator = activator_from_args(args)
    except ValueError as exc:
        print(f"kvfleet router: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args.host, args.port, urls, settings, discovery, activator))


async def _serve(
    host: str,
    port: int,
    urls: list[str],
    settings: object,
    discovery_settings: object = None,
    activator: object = None,
) -> int:
    import asyncio
    import signal

    from aiohttp import web
    from kvfleet.runtime.router.app import Router
    from kvfleet.runtime.router.discovery import PodDiscovery
    from kvfleet.runtime.router.replica_pool import ReplicaPool
    from kvfleet.runtime.server.http_runner import OpenAIAppRunner

    discovery = None
    if discovery_settings is not None:
        discovery = PodDiscovery(discovery_settings)  # type: ignore[arg-type]
    router = Router(ReplicaPool(urls), settings, discovery, activator)  # type: ignore[arg-type]
    # handler_cancellation: a client that hangs up cancels its handler, which closes the
    # upstream connection, so the replica stops generating for nobody.
    runner = OpenAIAppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()  # runs the first scrape: the replicas are known before serving
    site = web.TCPSite(runner, host, port, shutdown_timeout=10.0)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", host, port, exc)
        await runner.cleanup()
        return 1
    healthy = sum(r.healthy for r in router.pool.replicas)
    log.info(
        "routing on http://%s:%s over %d replicas (%d healthy)%s, policy %s",
        host,
        port,
        len(router.pool.replicas),
        healthy,
        f", pods {discovery.settings.selector} in {discovery.settings.namespace}"
        if discovery is not None
        else "",
        router.settings.policy.policy,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await runner.cleanup()
    return 0
