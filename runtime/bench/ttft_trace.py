"""Where concurrency-N TTFT goes: the standard workload through `LLMEngine` in this process,
closed loop (N requests in flight, the next one added when one ends), recording each request's
arrival, first schedule and first token and each step's duration. Before and after the run it
times the first wave's prompts (the first N) prefilled with nothing else running: the least
the last of them can wait, whatever the scheduling order (docs/benchmarks.md, "Time to first
token at concurrency 32").

Two settings are best compared in two processes at once, so that a shared host's load hits
both alike:

    python -m kvfleet.runtime.bench.ttft_trace out-0.json 128 32 num_threads=1 \\
        long_prefill_token_threshold=0 &
    python -m kvfleet.runtime.bench.ttft_trace out-256.json 128 32 num_threads=1 \\
        long_prefill_token_threshold=256

usage: ttft_trace OUT.json [num_prompts] [concurrency] [EngineConfig field=value ...]
(the model is `bundled` unless `model=...` is given)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from kvfleet.runtime.bench.workload import standard_workload
from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.sampling_params import SamplingParams


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _first_wave_alone(eng: LLMEngine, work: list, conc: int) -> float:
    """Seconds to prefill the first wave's prompts with nothing else running."""
    eng.kv.reset_prefix_cache()  # the run's own prompts must not hit
    t = time.monotonic()
    for i, w in enumerate(work[:conc]):
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        eng.add_request(f"b{i}-{t}", w.prompt_token_ids, params)
    while eng.has_unfinished_requests():
        eng.step()
    eng.kv.reset_prefix_cache()
    return time.monotonic() - t


def trace(eng: LLMEngine, num_prompts: int, conc: int) -> dict[str, Any]:
    """Run the closed loop; the summary, every request and every step."""
    work = standard_workload(eng.tokenizer, num_prompts, 0)
    alone_before = _first_wave_alone(eng, work, conc)
    requests: dict[str, dict[str, Any]] = {}
    live: dict[str, Any] = {}
    steps: list[dict[str, float]] = []
    t0 = time.monotonic()

    def add(i: int) -> None:
        w = work[i]
        params = SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True)
        eng.add_request(f"r{i}", w.prompt_token_ids, params)
        requests[f"r{i}"] = {"i": i, "prompt": len(w.prompt_token_ids), "out": w.output_len}
        live[f"r{i}"] = eng.scheduler.requests[f"r{i}"]

    added = min(conc, num_prompts)
    for i in range(added):
        add(i)
    finished: dict[str, Any] = {}
    while len(finished) < num_prompts:
        s0 = time.monotonic()
        outs = eng.step()
        steps.append({"t": s0 - t0, "dur": time.monotonic() - s0, "waiting": eng.num_waiting})
        for o in outs:
            if o.finished:
                finished[o.request_id] = live.pop(o.request_id)
                if added < num_prompts:
                    add(added)
                    added += 1
    alone_after = _first_wave_alone(eng, work, conc)

    rows = []
    for rid, d in requests.items():
        r = finished[rid]
        rows.append(
            d
            | {
                "arrival": r.arrival_time - t0,
                "first_sched": r.first_scheduled_time - t0,
                "first_token": r.first_token_time - t0,
                "ttft": r.first_token_time - r.arrival_time,
                "end": r.last_token_time - t0,
            }
        )
    first = [d for d in rows if d["i"] < conc]
    later = [d for d in rows if d["i"] >= conc] or first
    duration = max(d["end"] for d in rows)
    ttft = [d["ttft"] for d in rows]
    summary = {
        "num_prompts": num_prompts,
        "concurrency": conc,
        "duration_s": duration,
        "output_tokens_per_s": sum(d["out"] for d in rows) / duration,
        "ttft_p50": _percentile(ttft, 50),
        "ttft_p90": _percentile(ttft, 90),
        "ttft_p99": _percentile(ttft, 99),
        "ttft_p99_after_first_wave": _percentile([d["ttft"] for d in later], 99),
        "ttft_max_first_wave": max(d["ttft"] for d in first),
        "first_wave_prompt_tokens": sum(d["prompt"] for d in first),
        "first_wave_prefill_alone_s": [alone_before, alone_after],
        "max_wait_for_first_schedule_after_first_wave_s": max(
            d["first_sched"] - d["arrival"] for d in later
        ),
        "steps": len(steps),
        "preemptions": eng.scheduler.num_preemptions,
    }
    return {"summary": summary, "requests": rows, "steps": steps}


def main(argv: list[str]) -> None:
    out = argv[0]
    num_prompts = int(argv[1]) if len(argv) > 1 else 128
    conc = int(argv[2]) if len(argv) > 2 else 32
    fields: dict[str, Any] = {"model": "bundled"}
    for arg in argv[3:]:
        key, value = arg.split("=", 1)
        fields[key] = int(value) if value.lstrip("-").isdigit() else value
    eng = LLMEngine(EngineConfig(**fields))
    eng.warm_up()
    result = trace(eng, num_prompts, conc)
    result["summary"]["engine"] = fields
    print(json.dumps(result["summary"]))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
