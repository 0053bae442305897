"""The concurrency-N TTFT trace (docs/benchmarks.md) on a tiny random model."""

from __future__ import annotations

import json

from kvfleet.runtime.bench import ttft_trace


def test_the_trace_sees_every_request_and_the_first_wave(tmp_path):
    out = tmp_path / "trace.json"
    ttft_trace.main(
        [str(out), "6", "3", "model=random:tiny", "kv_cache_memory=64MiB", "max_model_len=1024"]
    )
    result = json.loads(out.read_text())
    summary, rows = result["summary"], result["requests"]
    assert sorted(d["i"] for d in rows) == list(range(6))
    assert all(0 <= d["arrival"] <= d["first_sched"] <= d["first_token"] <= d["end"] for d in rows)
    # The first wave arrives together; its slowest TTFT is at least its fastest's.
    first = [d for d in rows if d["i"] < 3]
    assert summary["ttft_max_first_wave"] == max(d["ttft"] for d in first)
    assert summary["first_wave_prompt_tokens"] == sum(d["prompt"] for d in first)
    assert summary["ttft_p50"] <= summary["ttft_p99"]
    assert len(summary["first_wave_prefill_alone_s"]) == 2 and summary["steps"] == len(
        result["steps"]
    )
    assert summary["engine"]["model"] == "random:tiny"
