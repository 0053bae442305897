"""Where concurrency-32 TTFT goes (issue 22): the standard workload through LLMEngine in this
process, closed loop (32 requests in flight, the next one added when one ends), recording each
request's arrival, first schedule and first token and each step's duration. Before and after
the run it times the first wave's prompts (the first 32) prefilled with nothing else running:
the least the last of them can wait, whatever the scheduling order.

It is the script behind docs/results/ttft-c32-trace-avx512bf16.json (run from the repository
root, two processes at once, one per setting, so that a shared host's load hits both alike):

    .venv/bin/python docs/results/ttft_c32_trace.py out-0.json 128 32 num_threads=1 \
        long_prefill_token_threshold=0
    .venv/bin/python docs/results/ttft_c32_trace.py out-256.json 128 32 num_threads=1 \
        long_prefill_token_threshold=256

usage: ttft_c32_trace.py OUT.json [num_prompts] [concurrency] [EngineConfig field=value ...]
"""

import json
import sys
import time

from kvfleet.runtime.bench.workload import standard_workload
from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.sampling_params import SamplingParams

out = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
conc = int(sys.argv[3]) if len(sys.argv) > 3 else 32
kw = {}
for a in sys.argv[4:]:
    k, v = a.split("=")
    kw[k] = int(v) if v.lstrip("-").isdigit() else v
eng = LLMEngine(EngineConfig(model="bundled", **kw))
eng.warm_up()
work = standard_workload(eng.tokenizer, n, 0)


def burst_bound() -> float:
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


bound_before = burst_bound()
reqs: dict = {}
steps = []
nxt = 0
inflight = set()


def add() -> None:
    global nxt
    w = work[nxt]
    rid = f"r{nxt}"
    params = SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True)
    eng.add_request(rid, w.prompt_token_ids, params)
    reqs[rid] = {
        "i": nxt,
        "prompt": len(w.prompt_token_ids),
        "out": w.output_len,
        "req": eng.scheduler.requests[rid],
    }
    inflight.add(rid)
    nxt += 1


t0 = time.monotonic()
while nxt < min(conc, n):
    add()
while inflight or nxt < n:
    s0 = time.monotonic()
    outs = eng.step()
    s1 = time.monotonic()
    steps.append({"t": s0 - t0, "dur": s1 - s0, "waiting": eng.num_waiting})
    for o in outs:
        if o.finished:
            inflight.discard(o.request_id)
            if nxt < n:
                add()
bound_after = burst_bound()
rows = []
for d in reqs.values():
    r = d.pop("req")
    d.update(
        arrival=r.arrival_time - t0,
        first_sched=r.first_scheduled_time - t0,
        first_token=r.first_token_time - t0,
        ttft=r.first_token_time - r.arrival_time,
        end=r.last_token_time - t0,
    )
    rows.append(d)


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


total_out = sum(d["out"] for d in rows)
dur = max(d["end"] for d in rows)
ttft = [d["ttft"] for d in rows]
summary = {
    "engine": kw,
    "num_prompts": n,
    "concurrency": conc,
    "duration_s": dur,
    "output_tokens_per_s": total_out / dur,
    "ttft_p50": pct(ttft, 50),
    "ttft_p90": pct(ttft, 90),
    "ttft_p99": pct(ttft, 99),
    "ttft_p99_after_first_wave": pct([d["ttft"] for d in rows if d["i"] >= conc], 99),
    "ttft_max_first_wave": max(d["ttft"] for d in rows if d["i"] < conc),
    "first_wave_prompt_tokens": sum(d["prompt"] for d in rows if d["i"] < conc),
    "first_wave_prefill_alone_s": [bound_before, bound_after],
    "max_wait_for_first_schedule_after_first_wave_s": max(
        d["first_sched"] - d["arrival"] for d in rows if d["i"] >= conc
    ),
    "steps": len(steps),
    "preemptions": eng.scheduler.num_preemptions,
}
print(json.dumps(summary))
with open(out, "w") as f:
    json.dump({"summary": summary, "requests": rows, "steps": steps}, f)
