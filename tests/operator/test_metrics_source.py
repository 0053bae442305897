"""Reading the autoscaler's signals: a real exposition from prometheus_client, real aiohttp
servers on 127.0.0.1 standing in for pods (good, hanging, failing) and for Prometheus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web
from kvfleet.operator.metrics_source import (
    MetricsParseError,
    MetricsUnavailable,
    PodTarget,
    parse_runtime_metrics,
    promql_queries,
    query_prometheus,
    scrape_pods,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvfleet.contract import (
    KV_CACHE_USAGE_PERC,
    METRICS_PATH,
    MODEL_NAME_LABEL,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
)

SHORT = 0.3  # seconds: the scrape timeout used against the hanging pod


def exposition(models: dict[str, tuple[float, float, float]]) -> str:
    """A /metrics page as the runtime writes it: {model_name: (waiting, running, kv_usage)}."""
    registry = CollectorRegistry()
    labels = [MODEL_NAME_LABEL]
    waiting = Gauge(NUM_REQUESTS_WAITING, "Requests waiting", labels, registry=registry)
    running = Gauge(NUM_REQUESTS_RUNNING, "Requests running", labels, registry=registry)
    kv = Gauge(KV_CACHE_USAGE_PERC, "KV-cache usage", labels, registry=registry)
    tokens = Counter(PROMPT_TOKENS, "Prompt tokens", labels, registry=registry)
    for model, (w, r, k) in models.items():
        waiting.labels(model).set(w)
        running.labels(model).set(r)
        kv.labels(model).set(k)
        tokens.labels(model).inc(123)
    return generate_latest(registry).decode()


# --- parsing --------------------------------------------------------------------------------


def test_parse_reads_the_three_signals():
    load = parse_runtime_metrics(exposition({"smollm2": (7, 3, 0.42)}))
    assert (load.waiting, load.running, load.kv_usage) == (7, 3, 0.42)


def test_parse_sums_counts_and_takes_the_fullest_cache_across_label_sets():
    load = parse_runtime_metrics(exposition({"a": (2, 1, 0.2), "b": (5, 4, 0.9)}))
    assert (load.waiting, load.running) == (7, 5)
    assert load.kv_usage == 0.9


def test_parse_rejects_a_page_without_the_signals():
    # A page from something else (or a runtime that failed to register its gauges) is no
    # data, not an idle pod.
    registry = CollectorRegistry()
    Gauge("process_open_fds", "fds", registry=registry).set(3)
    with pytest.raises(MetricsParseError, match=NUM_REQUESTS_WAITING):
        parse_runtime_metrics(generate_latest(registry).decode())


def test_parse_rejects_malformed_text():
    with pytest.raises(MetricsParseError, match="malformed"):
        parse_runtime_metrics('vllm:num_requests_waiting{model_name="x" 3\n')


def test_parse_rejects_nan():
    text = exposition({"m": (1, 1, 0.5)}).replace(
        f'{KV_CACHE_USAGE_PERC}{{model_name="m"}} 0.5',
        f'{KV_CACHE_USAGE_PERC}{{model_name="m"}} NaN',
    )
    with pytest.raises(MetricsParseError, match="finite"):
        parse_runtime_metrics(text)


# --- scraping pods ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[int]:
    """Run `app` on 127.0.0.1 on a free port; yields the port."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def pod_app(handler: Callable) -> web.Application:
    app = web.Application()
    app.router.add_get(METRICS_PATH, handler)
    return app


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def pod_port() -> AsyncIterator[int]:
    """One server answering as three pods, told apart by the loopback address they dial:
    127.0.0.1 is busy and healthy, 127.0.0.2 hangs, 127.0.0.3 answers 500."""
    release = asyncio.Event()

    async def metrics(request: web.Request) -> web.StreamResponse:
        host = request.transport.get_extra_info("sockname")[0]
        if host == "127.0.0.2":
            await asyncio.wait_for(release.wait(), timeout=5)  # bounded, even if never released
        if host == "127.0.0.3":
            return web.Response(status=500, text="engine crashed")
        return web.Response(text=exposition({"smollm2": (14, 6, 0.93)}))

    runner = web.AppRunner(pod_app(metrics), shutdown_timeout=0.1)
    await runner.setup()
    # Bind one socket per loopback address on the same port: the pods share port 8000 in a
    # cluster, and differ by IP, as here.
    first = web.TCPSite(runner, "127.0.0.1", 0)
    await first.start()
    port = runner.addresses[0][1]
    for host in ("127.0.0.2", "127.0.0.3"):
        await web.TCPSite(runner, host, port).start()
    try:
        yield port
    finally:
        release.set()
        await runner.cleanup()


async def test_scrape_good_hanging_and_failing_pods(pod_port, session):
    pods = [
        ("good", "127.0.0.1", True),
        ("hangs", "127.0.0.2", True),
        ("broken", "127.0.0.3", True),
        ("hangs-too", "127.0.0.2", True),
        ("hangs-three", "127.0.0.2", True),
        PodTarget("starting", "127.0.0.1", False),
        PodTarget("pending", "", True),
    ]
    loop = asyncio.get_running_loop()
    started = loop.time()
    samples = await scrape_pods(pods, pod_port, SHORT, session)
    elapsed = loop.time() - started

    assert [s.pod for s in samples] == [
        "good",
        "hangs",
        "broken",
        "hangs-too",
        "hangs-three",
        "starting",
        "pending",
    ]
    good, hangs, broken, _, _, starting, pending = samples
    assert good.scraped and good.ready
    assert (good.waiting, good.running, good.kv_usage) == (14, 6, 0.93)
    assert not hangs.scraped and "within 0.3s" in hangs.error
    assert not broken.scraped and "HTTP 500" in broken.error
    assert not starting.ready and not starting.scraped  # not ready: not even asked
    assert not pending.scraped and "no IP" in pending.error
    assert all(not s.scraped for s in samples[3:5])
    # Concurrent: three hanging pods cost one timeout, not three in turn.
    assert elapsed < 2.5 * SHORT


async def test_scrape_refused_connection_is_a_failed_sample(session):
    # Grab a free port, then close it, so nothing listens there.
    async with serve(web.Application()) as port:
        closed_port = port
    samples = await scrape_pods([("gone", "127.0.0.1", True)], closed_port, SHORT, session)
    assert not samples[0].scraped and samples[0].error


async def test_scrape_of_a_page_without_signals_is_a_failed_sample(session):
    async def not_a_runtime(request: web.Request) -> web.Response:
        return web.Response(text="# nothing here\n")

    async with serve(pod_app(not_a_runtime)) as port:
        samples = await scrape_pods([("odd", "127.0.0.1", True)], port, SHORT, session)
    assert not samples[0].scraped
    assert NUM_REQUESTS_WAITING in samples[0].error


# --- Prometheus -------------------------------------------------------------------------------


def vector(values: dict[str, float]) -> dict:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": {"pod": pod}, "value": [1700000000.0, str(value)]}
                for pod, value in values.items()
            ],
        },
    }


def prometheus_app(answers: dict[str, dict[str, float]], seen: list[str]) -> web.Application:
    """Answers /api/v1/query like Prometheus, picking the vector by the metric in the query."""

    async def query(request: web.Request) -> web.Response:
        promql = request.query["query"]
        seen.append(promql)
        for metric, values in answers.items():
            if metric in promql:
                return web.json_response(vector(values))
        return web.json_response(
            {"status": "error", "errorType": "bad_data", "error": "parse error"}, status=400
        )

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    return app


def test_promql_selects_the_service_pods_and_groups_by_pod():
    queries = promql_queries("team-a", "chat")
    selector = '{namespace="team-a", app_kubernetes_io_instance="chat"}'
    assert queries == {
        "waiting": f"sum by (pod) ({NUM_REQUESTS_WAITING}{selector})",
        "running": f"sum by (pod) ({NUM_REQUESTS_RUNNING}{selector})",
        "kv_usage": f"max by (pod) ({KV_CACHE_USAGE_PERC}{selector})",
        "finished": f"sum by (pod) ({REQUEST_SUCCESS}_total{selector})",
    }


async def test_prometheus_query_reads_every_pod(session):
    answers = {
        NUM_REQUESTS_WAITING: {"chat-a": 9, "chat-b": 3},
        NUM_REQUESTS_RUNNING: {"chat-a": 8, "chat-b": 8},
        KV_CACHE_USAGE_PERC: {"chat-a": 0.91, "chat-b": 0.55},
        REQUEST_SUCCESS: {"chat-a": 120},  # chat-b finished none yet: no series, which is 0
    }
    seen: list[str] = []
    async with serve(prometheus_app(answers, seen)) as port:
        samples = await query_prometheus(
            f"http://127.0.0.1:{port}/", "team-a", "chat", session, timeout=2
        )
    assert sorted(seen) == sorted(promql_queries("team-a", "chat").values())
    by_pod = {s.pod: s for s in samples}
    assert set(by_pod) == {"chat-a", "chat-b"}
    assert (by_pod["chat-a"].waiting, by_pod["chat-a"].running, by_pod["chat-a"].kv_usage) == (
        9,
        8,
        0.91,
    )
    assert all(s.scraped and s.ready for s in samples)
    assert (by_pod["chat-a"].finished, by_pod["chat-b"].finished) == (120, 0)


async def test_prometheus_query_against_the_operator_pod_list(session):
    # chat-c is new (no series yet), chat-old is gone (stale series), chat-d is not ready.
    answers = {
        NUM_REQUESTS_WAITING: {"chat-a": 9, "chat-old": 50, "chat-d": 1},
        NUM_REQUESTS_RUNNING: {"chat-a": 8, "chat-old": 8, "chat-d": 1},
        KV_CACHE_USAGE_PERC: {"chat-a": 0.91, "chat-old": 1.0, "chat-d": 0.1},
        REQUEST_SUCCESS: {},
    }
    pods = [("chat-a", "10.0.0.1", True), ("chat-c", "10.0.0.3", True), ("chat-d", "", False)]
    async with serve(prometheus_app(answers, [])) as port:
        samples = await query_prometheus(
            f"http://127.0.0.1:{port}", "team-a", "chat", session, timeout=2, pods=pods
        )
    assert [s.pod for s in samples] == ["chat-a", "chat-c", "chat-d"]
    assert samples[0].scraped and samples[0].waiting == 9
    assert not samples[1].scraped and "no waiting, running, kv_usage series" in samples[1].error
    assert not samples[2].ready and not samples[2].scraped


async def test_prometheus_error_answer_raises_with_its_message(session):
    async with serve(prometheus_app({}, [])) as port:
        with pytest.raises(MetricsUnavailable, match="HTTP 400: parse error"):
            await query_prometheus(f"http://127.0.0.1:{port}", "ns", "chat", session, timeout=2)


async def test_prometheus_unreachable_raises(session):
    async with serve(web.Application()) as port:
        closed_port = port
    with pytest.raises(MetricsUnavailable, match="Prometheus"):
        await query_prometheus(f"http://127.0.0.1:{closed_port}", "ns", "chat", session, 1)
