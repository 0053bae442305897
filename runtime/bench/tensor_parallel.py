"""`kvfleet bench tensor-parallel`: one engine sharded over N ranks against the same model in
one process, in the same run, interleaved round by round so that a host's drifting speed
touches both alike.

Each round runs, on each engine, a prefill of `--num-prompts` prompts of `--prompt-len` random
tokens (max_tokens 1) and then the same prompts with `--new-tokens` greedy tokens; the decode
time per step is the difference over the extra steps. The one-process engine runs with all the
host's cores (or --num-threads), each rank with its share (`tp_workers.threads_per_rank`):
torch's thread count is per process, so it is set before each engine's turn. The greedy tokens
of both are compared too (they must be the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tensor-parallel",
        help="an engine sharded over --tensor-parallel-size ranks against one process, "
        "interleaved (prefill time, decode ms/step, same greedy tokens)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    add_engine_args(p)
    p.set_defaults(func=run, tensor_parallel_size=2)  # after the flag exists: it takes this


def _timed(llm: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list]:
    """(prefill seconds, decode seconds per step, greedy tokens) of one engine, from one run:
    the clock is read when every prompt has its first token and again at the end (two runs
    subtracted could come out negative on a busy host)."""
    from kvfleet.runtime.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=1 + new_tokens, temperature=0, ignore_eos=True)
    ids = [f"tp-bench-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    prefilled = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        if prefilled is None and len(tokens) == len(ids) and all(tokens.values()):
            prefilled = time.perf_counter()
    end = time.perf_counter()
    prefilled = prefilled or end
    return prefilled - start, (end - prefilled) / new_tokens, [tokens[r] for r in ids]


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.engine.tp_workers import threads_per_rank, usable_cores

    config = engine_config_from_args(args)
    size = config.tensor_parallel_size
    if size < 2:
        print("kvfleet bench tensor-parallel: error: --tensor-parallel-size must be >= 2",
              file=sys.stderr)  # fmt: skip
        return 2
    cores = usable_cores()
    one_threads = config.num_threads or cores
    rank_threads = threads_per_rank(cores, size, config.num_threads)
    sharded = LLM(config)
    try:
        single = LLM(dataclasses.replace(config, tensor_parallel_size=1, num_threads=one_threads))
    except BaseException:
        sharded.close()
        raise
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, 40000, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.num_prompts)
    ]
    rounds: list[dict[str, float]] = []
    first: list | None = None
    same = True
    try:
        for r in range(args.rounds):
            row: dict[str, float] = {}
            # Alternate which goes first, so neither always gets the warmer (or cooler) host.
            order = [("tp1", single, one_threads), (f"tp{size}", sharded, rank_threads)]
            for name, llm, threads in order if r % 2 == 0 else order[::-1]:
                torch.set_num_threads(threads)
                prefill, decode, tokens = _timed(llm, prompts, args.new_tokens)
                row[f"{name}_prefill_s"], row[f"{name}_decode_ms"] = prefill, decode * 1e3
                first = tokens if first is None else first
                same = same and tokens == first
            rounds.append(row)
            print(json.dumps({"round": r, **{k: round(v, 4) for k, v in row.items()}}))
    finally:
        sharded.close()
    medians = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
    result = {
        "model": config.model,
        "dtype": str(single.engine.dtype).removeprefix("torch."),
        "device": str(single.engine.device),
        "tensor_parallel_size": size,
        "threads_one_process": one_threads,
        "threads_per_rank": rank_threads,
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "same_greedy_tokens": same,
        # A shared host's load changes these figures more than anything measured here.
        "load_average_1m_at_end": os.getloadavg()[0],
        "median": medians,
        "rounds": rounds,
    }
    summary = {k: round(v, 4) for k, v in medians.items()}
    print(json.dumps({"median": summary, "same_greedy_tokens": same}))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if same else 1
