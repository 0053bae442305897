"""The runtime's Prometheus metrics, named as vLLM names them (kvfleet.contract) so existing
dashboards, alerts and the operator's autoscaler read them unchanged.

Latency histograms are observed by the output processor as each step's tokens arrive from the
engine core (the `SequenceObserver` hooks), with the core's own step times. Gauges and counters
are read at scrape time from the `EngineStats` snapshot the core sends after every step, so the
exposed counters are exactly the core's own and never drift from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet import contract

if TYPE_CHECKING:
    from kvfleet.runtime.engine.async_engine import AsyncEngine
    from kvfleet.runtime.engine.core_messages import EngineStats
    from kvfleet.runtime.engine.output_processor import SequenceState

# vLLM's buckets: sub-10 ms steps on a GPU up to minutes for long CPU generations.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# Token counts per request: 1-2-5 steps (vLLM's scheme) up to a million tokens of context.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))

FINISH_REASONS = ("stop", "length", "abort", "error")


def cache_config_labels(engine: AsyncEngine) -> dict[str, str] | None:
    """`vllm:cache_config_info`'s labels, as vLLM spells them; None until the model is loaded
    (the number of blocks is only known then)."""
    info = engine.info
    if info is None:
        return None
    return {
        "block_size": str(info.block_size),
        "num_gpu_blocks": str(info.num_blocks),  # vLLM's label name, whatever the device
        "enable_prefix_caching": str(info.enable_prefix_caching),
        "cache_dtype": info.kv_cache_dtype,
    }


class RuntimeMetrics:
    """One registry per server: the SequenceObserver for histograms plus a collector for the
    engine's gauges and counters (and, given `cache_config`, the KV cache's info gauge)."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        cache_config: Callable[[], dict[str, str] | None] = lambda: None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = [contract.MODEL_NAME_LABEL]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)  # type: ignore[return-value]

        self._ttft = histogram(
            contract.TIME_TO_FIRST_TOKEN, "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self._itl = histogram(
            contract.INTER_TOKEN_LATENCY, "Time between consecutive output tokens.", ITL_BUCKETS
        )
        self._e2e = histogram(
            contract.E2E_REQUEST_LATENCY,
            "Time from arrival to the last token of a finished request.",
            REQUEST_BUCKETS,
        )
        self._queue = histogram(
            contract.REQUEST_QUEUE_TIME,
            "Time a request waited before it was first scheduled.",
            REQUEST_BUCKETS,
        )
        self._prompt_tokens = histogram(
            contract.REQUEST_PROMPT_TOKENS, "Prompt tokens of a finished request.", TOKEN_BUCKETS
        )
        self._generation_tokens = histogram(
            contract.REQUEST_GENERATION_TOKENS,
            "Tokens generated for a finished request.",
            TOKEN_BUCKETS,
        )
        self._prefill = histogram(
            contract.REQUEST_PREFILL_TIME,
            "Time from a request's first scheduling to its first token.",
            REQUEST_BUCKETS,
        )
        self._decode = histogram(
            contract.REQUEST_DECODE_TIME,
            "Time from a request's first token to its last.",
            REQUEST_BUCKETS,
        )
        self._inference = histogram(
            contract.REQUEST_INFERENCE_TIME,
            "Time from a request's first scheduling to its last token.",
            REQUEST_BUCKETS,
        )
        self.registry.register(_EngineCollector(model_name, stats, cache_config))

    # --- SequenceObserver (called by the output processor) -----------------------------------
    def on_first_token(self, request: SequenceState, now: float) -> None:
        self._ttft.observe(max(now - request.arrival_time, 0.0))
        if request.first_scheduled_time is not None:
            self._queue.observe(max(request.first_scheduled_time - request.arrival_time, 0.0))

    def on_token(self, request: SequenceState, now: float) -> None:
        if request.last_token_time is not None:
            self._itl.observe(max(now - request.last_token_time, 0.0))

    def on_finished(self, request: SequenceState, now: float) -> None:
        # Aborted and failed requests are counted by reason but left out of the latency
        # histograms: a client hanging up says nothing about how fast the server is.
        if request.finish_reason in ("abort", "error"):
            return
        self._e2e.observe(max(now - request.arrival_time, 0.0))
        self._prompt_tokens.observe(request.num_prompt_tokens)
        self._generation_tokens.observe(request.num_output_tokens)
        if request.first_scheduled_time is not None:
            self._inference.observe(max(now - request.first_scheduled_time, 0.0))
            if request.first_token_time is not None:
                self._prefill.observe(
                    max(request.first_token_time - request.first_scheduled_time, 0.0)
                )
        if request.first_token_time is not None:
            self._decode.observe(max(now - request.first_token_time, 0.0))

    def exposition(self) -> bytes:
        """The text format served on /metrics."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        cache_config: Callable[[], dict[str, str] | None],
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._cache_config = cache_config

    def collect(self) -> Iterator[Metric]:
        from kvfleet.runtime.engine.core_messages import EngineStats

        s = self._stats() or EngineStats()
        label = [contract.MODEL_NAME_LABEL]
        value = [self._model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric(value, v)
            return c

        yield gauge(contract.NUM_REQUESTS_RUNNING, "Requests in the running batch.", s.num_running)
        yield gauge(
            contract.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", s.num_waiting
        )
        yield gauge(
            contract.KV_CACHE_USAGE_PERC,
            "Fraction of KV-cache blocks held by live requests (1 = full).",
            s.kv_cache_usage,
        )
        yield counter(contract.PROMPT_TOKENS, "Prompt tokens received.", s.prompt_tokens)
        yield counter(contract.GENERATION_TOKENS, "Tokens generated.", s.generation_tokens)
        yield counter(
            contract.NUM_PREEMPTIONS, "Requests preempted for KV-cache space.", s.num_preemptions
        )
        yield counter(
            contract.PREFIX_CACHE_QUERIES,
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            contract.PREFIX_CACHE_HITS,
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        )
        success = CounterMetricFamily(
            contract.REQUEST_SUCCESS,
            "Finished requests by finish reason.",
            labels=[contract.MODEL_NAME_LABEL, contract.FINISHED_REASON_LABEL],
        )
        # Every usual reason is present from the start, so rate() sees the first one.
        for reason in sorted(set(FINISH_REASONS) | set(s.finished)):
            success.add_metric([self._model_name, reason], s.finished.get(reason, 0))
        yield success
        if s.spec_accepted_per_position:
            yield from _spec_decode_counters(s, self._model_name)
        cache = self._cache_config()
        if cache is not None:
            info = GaugeMetricFamily(
                contract.CACHE_CONFIG_INFO,
                "KV cache configuration, in the labels (value 1).",
                labels=[contract.MODEL_NAME_LABEL, *cache],
            )
            info.add_metric([self._model_name, *cache.values()], 1.0)
            yield info


def _spec_decode_counters(s: EngineStats, model_name: str) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters (only under --speculative-config)."""
    for name, doc, v in (
        (contract.SPEC_DECODE_NUM_DRAFTS, "Draft proposals verified.", s.spec_drafts),
        (contract.SPEC_DECODE_NUM_DRAFT_TOKENS, "Draft tokens verified.", s.spec_draft_tokens),
        (
            contract.SPEC_DECODE_NUM_ACCEPTED_TOKENS,
            "Draft tokens the model accepted.",
            s.spec_accepted_tokens,
        ),
    ):
        c = CounterMetricFamily(name, doc, labels=[contract.MODEL_NAME_LABEL])
        c.add_metric([model_name], v)
        yield c
    per_pos = CounterMetricFamily(
        contract.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
        "Draft tokens accepted, by their position in the proposal (0: the first).",
        labels=[contract.MODEL_NAME_LABEL, contract.POSITION_LABEL],
    )
    for pos, v in enumerate(s.spec_accepted_per_position):
        per_pos.add_metric([model_name, str(pos)], v)
    yield per_pos
