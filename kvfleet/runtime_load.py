"""Reading a runtime's load from its /metrics page: the one parser the operator's autoscaler
and the router share.

Torch-free and kopf-free, like contract.py: the operator and `kvfleet router` both import it,
and neither may import the other's half (docs/architecture.md, "Boundaries").

Several series per metric (one per `model_name` label set) are combined per page:
- waiting and running requests are counts, so they are summed;
- KV-cache usage takes the maximum, not the mean: the fullest cache is the one that queues
  and preempts requests, and averaging it with an idle one would hide the pressure;
- the block size (from the optional `vllm:cache_config_info`, GIE's model-server protocol)
  is the smallest one found: a prefix shorter than a full block is never cached;
- the LoRA adapters loaded are the `lora_name` labels of `kvfleet:lora_adapter_loaded` series
  of value 1 (a server without --enable-lora has none), for the router's adapter affinity.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from kvfleet.contract import (
    CACHE_CONFIG_INFO,
    KV_CACHE_USAGE_PERC,
    LORA_ADAPTER_LOADED,
    LORA_NAME_LABEL,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    REQUEST_SUCCESS,
)


class MetricsParseError(ValueError):
    """A /metrics page that does not carry the runtime's load signals."""


class RuntimeLoad(NamedTuple):
    """The signals one runtime reports; `block_size` is None where it does not say."""

    waiting: float
    running: float
    kv_usage: float
    block_size: int | None = None
    # vllm:request_success_total summed over its label sets: requests finished, ever. 0 where
    # the counter has no sample yet (no request finished since the runtime started).
    finished: float = 0.0
    adapters: frozenset[str] = frozenset()  # the LoRA adapters loaded, by name


def parse_runtime_metrics(text: str) -> RuntimeLoad:
    """Read the runtime's load (waiting, running, kv_usage, block_size, finished, adapters) from
    a Prometheus text exposition.

    Raises MetricsParseError when the text is malformed or lacks one of the three gauges:
    a page without them is not a kvfleet/vLLM runtime, and absent is not zero.
    """
    values: dict[str, list[float]] = {
        NUM_REQUESTS_WAITING: [],
        NUM_REQUESTS_RUNNING: [],
        KV_CACHE_USAGE_PERC: [],
    }
    block_sizes: list[int] = []
    finished = 0.0
    adapters: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in values:
                    values[sample.name].append(sample.value)
                elif sample.name == f"{REQUEST_SUCCESS}_total" and math.isfinite(sample.value):
                    finished += sample.value
                elif sample.name == CACHE_CONFIG_INFO:
                    size = sample.labels.get("block_size", "")
                    if size.isdigit() and int(size) > 0:
                        block_sizes.append(int(size))
                elif sample.name == LORA_ADAPTER_LOADED and sample.value == 1:
                    adapters.add(sample.labels.get(LORA_NAME_LABEL, ""))
    except ValueError as error:
        raise MetricsParseError(f"malformed metrics text: {error}") from error
    for name, found in values.items():
        if not found:
            raise MetricsParseError(f"metric {name} missing from /metrics")
        if not all(math.isfinite(v) for v in found):
            raise MetricsParseError(f"metric {name} is not a finite number: {found}")
    return RuntimeLoad(
        waiting=sum(values[NUM_REQUESTS_WAITING]),
        running=sum(values[NUM_REQUESTS_RUNNING]),
        kv_usage=max(values[KV_CACHE_USAGE_PERC]),
        block_size=min(block_sizes) if block_sizes else None,
        finished=finished,
        adapters=frozenset(adapters - {""}),
    )
