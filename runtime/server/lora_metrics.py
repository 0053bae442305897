"""The LoRA series on /metrics, under --enable-lora: vLLM's `vllm:lora_requests_info` (the
adapters running and waiting, in its labels, as vLLM's dashboards read them) and
`kvfleet:lora_adapter_loaded` per adapter the server answers to, which the operator and the
router read to know where each adapter is loaded."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from kvfleet.runtime.engine.core_messages import EngineStats
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet import contract


class LoraCollector(Collector):
    def __init__(
        self,
        max_loras: int,
        loaded: Callable[[], list[str]],
        stats: Callable[[], EngineStats | None],
    ) -> None:
        self._max_loras = max_loras
        self._loaded = loaded
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats() or EngineStats()
        info = GaugeMetricFamily(
            contract.LORA_REQUESTS_INFO,
            "LoRA adapters of running and waiting requests, in the labels (value: when).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(
            [str(self._max_loras), ",".join(s.lora_running), ",".join(s.lora_waiting)],
            time.time(),
        )
        yield info
        loaded = GaugeMetricFamily(
            contract.LORA_ADAPTER_LOADED,
            "LoRA adapters this server answers to (value 1 each).",
            labels=[contract.LORA_NAME_LABEL],
        )
        for name in self._loaded():
            loaded.add_metric([name], 1.0)
        yield loaded
