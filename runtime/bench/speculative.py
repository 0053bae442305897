"""`kvfleet bench latency --speculative-config ...`: what speculative decoding gains one stream,
against the same engine with speculation off, in turns, in one run.

Two workloads, greedy, one request at a time through the engine (everything but HTTP):
- grounded: the output repeats its input: Python functions of the standard library to be
  given back with a docstring added, and passages of those functions' docstrings to be
  repeated word for word (where prompt lookup finds its drafts);
- open: questions and stories with nothing to copy (where drafts mostly fail and cost).
Each prompt runs with speculation on and off in turns; a workload's output tokens/s is its
tokens over its wall time, and its decode rate the tokens after the first over the time after
the prompts (a turn of the same prompts with one output token each, in the same run). Beside each figure: the acceptance rate (accepted / draft tokens)
and the tokens a verify step gains on average. Then `--concurrency` requests at once, on and
off in turns: what speculation costs a full batch (above disable_by_batch_size it turns
itself off).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.sampling_params import SamplingParams


def _grounded_prompts() -> list[str]:
    import calendar
    import colorsys
    import fnmatch
    import shlex
    import string
    import textwrap

    functions = [textwrap.indent, shlex.quote, string.capwords, fnmatch.filter, calendar.monthrange]
    prompts = [
        "Add a one-line docstring to this Python function. Reply with the whole function, the "
        f"code unchanged.\n\n```python\n{inspect.getsource(f)}```"
        for f in functions
    ]
    passages = [inspect.getdoc(m) or "" for m in (colorsys, textwrap.dedent, shlex.split)]
    prompts += [f"Repeat this text word for word:\n\n{p[:600]}" for p in passages if p]
    return prompts


OPEN_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Give me three ideas for a birthday party.",
    "Why do leaves change colour in autumn?",
    "Describe a walk through a market in spring.",
    "What makes a good team leader?",
    "Invent a new board game and explain its rules.",
]


def _turn(llm: Any, prompts: list[str], on: bool, max_tokens: int, together: bool) -> dict:
    """Generate `prompts` (one at a time, or all at once when `together`) with speculation on
    or off: output tokens, seconds, and the speculator's counters over the turn."""
    spec = llm.engine.core.speculator
    spec.enabled = on
    c = spec.counters
    before = (c.drafts, c.draft_tokens, c.accepted_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.engine.core.kv.reset_prefix_cache()  # every turn computes its prompts: same work
    started = time.perf_counter()
    if together:
        outs = llm.chat(chats, params)
    else:
        outs = [llm.chat(chat, params)[0] for chat in chats]
    seconds = time.perf_counter() - started
    return {
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": seconds,
        "drafts": c.drafts - before[0],
        "draft_tokens": c.draft_tokens - before[1],
        "accepted_tokens": c.accepted_tokens - before[2],
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def _compare(llm: Any, name: str, prompts: list[str], args: Any, together: bool) -> dict:
    """Speculation off and on in turns (`args.repeats` of each); the faster turn of each."""
    turns: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(args.repeats):
        # Off-on, then on-off: a host whose speed drifts within minutes favours neither.
        for on in (False, True) if i % 2 == 0 else (True, False):
            turns[on].append(_turn(llm, prompts, on, args.max_tokens, together))
    best = {on: min(ts, key=lambda t: t["seconds"]) for on, ts in turns.items()}
    # The prompts alone (one output token each), in the same run: what a turn spends before
    # decoding, which speculation does not touch.
    prefill = min(_turn(llm, prompts, False, 1, together)["seconds"] for _ in range(args.repeats))
    on_drafts = sum(t["draft_tokens"] for t in turns[True])
    accepted = sum(t["accepted_tokens"] for t in turns[True])
    proposals = sum(t["drafts"] for t in turns[True])
    off_tps = best[False]["tokens"] / best[False]["seconds"]
    on_tps = best[True]["tokens"] / best[True]["seconds"]
    decode = {
        on: (t["tokens"] - len(prompts)) / max(t["seconds"] - prefill, 1e-9)
        for on, t in best.items()
    }
    return {
        "workload": name,
        "requests": len(prompts),
        "concurrent": together,
        "output_tokens": best[True]["tokens"],
        "off_tokens_per_s": round(off_tps, 2),
        "on_tokens_per_s": round(on_tps, 2),
        "speedup": round(on_tps / off_tps, 3),
        "prefill_seconds": round(prefill, 3),
        # Tokens after the first over the time after the prompts: the decode rate.
        "off_decode_tokens_per_s": round(decode[False], 2),
        "on_decode_tokens_per_s": round(decode[True], 2),
        "decode_speedup": round(decode[True] / decode[False], 3),
        "acceptance_rate": round(accepted / on_drafts, 3) if on_drafts else None,
        "accepted_per_proposal": round(accepted / proposals, 2) if proposals else None,
        # Greedy: speculation must not change a token (a check, not a speed figure).
        "same_tokens": best[True]["token_ids"] == best[False]["token_ids"],
    }


def add_speculative_bench_args(p: Any) -> None:
    """The flags only a `bench latency --speculative-config` run reads."""
    g = p.add_argument_group("with --speculative-config")
    g.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    g.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="requests at once in the last comparison (1: skip it; default 32)",
    )


def measure_speculative(config: EngineConfig, args: Any) -> dict:
    """Every workload's row; the report `print_speculative` prints."""
    from kvfleet.kernels.cpu import cpu_features
    from kvfleet.runtime.engine.llm import LLM

    grounded = _grounded_prompts()
    llm = LLM(config)
    spec = config.speculative_config
    assert spec is not None
    for on in (True, False):  # first calls (chat template, kernels) outside every turn
        _turn(llm, grounded[:1], on, 8, together=False)
    rows = [
        _compare(llm, "grounded", grounded, args, together=False),
        _compare(llm, "open", OPEN_PROMPTS, args, together=False),
    ]
    if args.concurrency > 1:
        batch = (grounded + OPEN_PROMPTS) * -(-args.concurrency // (len(grounded) + 6))
        rows.append(_compare(llm, "mixed", batch[: args.concurrency], args, together=True))
    llm.close()
    return {
        "model": config.model,
        "device": str(llm.engine.device),
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "cpu_flags": cpu_features.kernel_flags() if llm.engine.device.type == "cpu" else [],
        "speculative_config": {k: getattr(spec, k) for k in spec.__slots__},
        "max_tokens": args.max_tokens,
        "rows": rows,
    }


def print_speculative(report: dict) -> None:
    print(f"speculative decoding: {report['speculative_config']}")
    print(f"model {report['model']} on {report['device']} ({report['dtype']}), "
          f"cpu: {report['cpu_flags']}")  # fmt: skip
    print(f"{'workload':<10}{'requests':>9}{'off tok/s':>11}{'on tok/s':>10}{'speedup':>9}"
          f"{'decode':>9}{'accepted':>10}{'per step':>10}  same tokens")  # fmt: skip
    for r in report["rows"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        per = "-" if r["accepted_per_proposal"] is None else f"{r['accepted_per_proposal']:.2f}"
        shape = f"{r['requests']}{' at once' if r['concurrent'] else ''}"
        print(f"{r['workload']:<10}{shape:>9}{r['off_tokens_per_s']:>11.1f}"
              f"{r['on_tokens_per_s']:>10.1f}{r['speedup']:>8.2f}x{r['decode_speedup']:>8.2f}x"
              f"{rate:>10}{per:>10}  "
              f"{r['same_tokens']}")  # fmt: skip
