"""kvfleet/runtime_load.py, the /metrics parser the autoscaler and the router share, reading
the page `kvfleet serve` writes: the three load gauges and the KV block size that GIE's
model-server protocol puts in `vllm:cache_config_info`."""

from __future__ import annotations

import pytest

from kvfleet import contract
from kvfleet.runtime_load import MetricsParseError, parse_runtime_metrics


def runtime_page(cache: dict[str, str] | None) -> str:
    from kvfleet.runtime.engine.core_messages import EngineStats
    from kvfleet.runtime.server.metrics import RuntimeMetrics

    stats = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25)
    return RuntimeMetrics("m", lambda: stats, lambda: cache).exposition().decode()


def test_the_runtimes_own_page_gives_its_load_and_block_size():
    cache = {"block_size": "16", "num_gpu_blocks": "4096", "enable_prefix_caching": "True"}
    load = parse_runtime_metrics(runtime_page(cache))
    assert (load.waiting, load.running, load.kv_usage, load.block_size) == (2, 3, 0.25, 16)
    assert f'{contract.CACHE_CONFIG_INFO}{{block_size="16"' in runtime_page(cache)


def test_no_cache_info_before_the_model_is_loaded_means_no_block_size():
    page = runtime_page(None)
    assert contract.CACHE_CONFIG_INFO not in page
    assert parse_runtime_metrics(page).block_size is None


def test_the_smallest_block_size_of_several_label_sets_counts():
    page = runtime_page(None) + (
        f'{contract.CACHE_CONFIG_INFO}{{block_size="32"}} 1.0\n'
        f'{contract.CACHE_CONFIG_INFO}{{block_size="8"}} 1.0\n'
        f'{contract.CACHE_CONFIG_INFO}{{block_size="many"}} 1.0\n'
    )
    assert parse_runtime_metrics(page).block_size == 8


def test_a_page_without_the_load_gauges_is_refused():
    with pytest.raises(MetricsParseError, match=contract.NUM_REQUESTS_WAITING):
        parse_runtime_metrics(f'{contract.CACHE_CONFIG_INFO}{{block_size="16"}} 1.0\n')


def test_finished_requests_are_summed_over_finish_reasons():
    # Scale to zero's idle clock: requests that finished between two polls move this count.
    from kvfleet.runtime.engine.core_messages import EngineStats
    from kvfleet.runtime.server.metrics import RuntimeMetrics

    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0)
    stats.finished.update({"stop": 4, "length": 3})
    page = RuntimeMetrics("m", lambda: stats, lambda: None).exposition().decode()
    assert parse_runtime_metrics(page).finished == 7
    assert parse_runtime_metrics(runtime_page(None)).finished == 0
