"""`kvfleet bench serve`: drive any OpenAI-compatible server with the standard workload (streamed
completions, token-id prompts, ignore_eos so every request produces its output length) and
report request/s, output tokens/s, TTFT, inter-token and end-to-end latency percentiles.

Scenario flags measure a feature against its off-switch in the same command (`--spawn` starts
the server once per setting): `--shared-prefix N` (prefix caching on vs off, TTFT) and
`--long-prompt-every K` (chunked prefill on vs off, inter-token latency p99), and with
`--replicas N` prefix-aware routing vs random placement over N replicas behind `kvfleet
router` (prefix hit rate, TTFT; serve_routing.py). With
`--offline-baseline`, a plain `--spawn` run is bracketed by two runs of `kvfleet bench
throughput --baseline none` on the same workload and engine flags, and the JSON's
`offline_ratio` is serving's output tokens/s over their mean: the host's drift during the
command cancels to first order, as in `bench throughput`'s own A-B-A order. Each run reports
the CPU seconds its parts used (`cpu_seconds`: the client, and with `--spawn` the server and the
engine core) beside the core-seconds the host had, and each offline run its own
(`offline_cpu_seconds_runs`): on a small CPU host a served run can lack cores rather than speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvfleet.runtime.bench.serve_client import RunResult, drive
from kvfleet.runtime.bench.serve_spawn import offline_throughput, spawned_server
from kvfleet.runtime.engine.engine_args import add_engine_args

# --long-prompt-every's prompts, in step budgets (--max-num-batched-tokens): longer than one
# step, so that chunking has something to split.
LONG_PROMPT_BUDGETS = 2
SHARED_PREFIX_CONCURRENCY = 8


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="latency and throughput of an OpenAI-compatible server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server to drive (ignored with --spawn)"
    )
    p.add_argument(
        "--spawn",
        action="store_true",
        help="start `kvfleet serve` with the engine flags below, once per setting",
    )
    p.add_argument(
        "--serve-args", default="", help="extra flags for the spawned server, as one string"
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="TOKENS",
        help="every prompt starts with the same TOKENS-token text; prefix caching "
        f"on vs off at concurrency {SHARED_PREFIX_CONCURRENCY} (needs --spawn)",
    )
    p.add_argument(
        "--num-prefixes",
        type=int,
        default=1,
        metavar="K",
        help="with --shared-prefix: K different shared prefixes (system prompts), each prompt "
        "starting with one of them at random",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="N",
        help="start N replicas behind `kvfleet router` and compare --policy prefix with "
        "random: prefix hit rate and TTFT (needs --spawn and --shared-prefix; the replicas get "
        "--serve-args and the engine flags)",
    )
    p.add_argument(
        "--long-prompt-every",
        type=int,
        default=0,
        metavar="K",
        help=f"every K-th request has a prompt of {LONG_PROMPT_BUDGETS} x "
        "--max-num-batched-tokens tokens; chunked prefill on vs off (needs --spawn)",
    )
    p.add_argument(
        "--concurrency-sweep",
        default=None,
        metavar="C1,C2,...",
        help="drive one spawned server at each concurrency in turn (needs --spawn)",
    )
    p.add_argument(
        "--offline-baseline",
        action="store_true",
        help="run `kvfleet bench throughput --baseline none` with the same engine flags before "
        "and after the served run and report serving's throughput over theirs (needs --spawn; "
        "--serve-args go to the server only)",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="the cost of structured outputs: the workload once plain and once with every "
        "request constrained to this JSON schema (response_format), each on a fresh server "
        "(needs --spawn)",
    )
    p.add_argument(
        "--distinct-schemas",
        action="store_true",
        help="with --json-schema: each request's schema made its own (one more optional "
        "property), so that every request's grammar is compiled while the others decode",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="latency CDFs of each run (or, with --concurrency-sweep, throughput and latency "
        "against concurrency)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    add_engine_args(p, serving=True)  # the flags of the server it spawns
    p.set_defaults(func=run)


def long_prompt_tokens(args: argparse.Namespace) -> int:
    return LONG_PROMPT_BUDGETS * args.max_num_batched_tokens


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list[tuple[list[int], int]]:
    """The standard workload, with the scenario's shared prefix or long prompts mixed in."""
    import numpy as np
    from kvfleet.runtime.bench.workload import standard_workload

    items = [
        (w.prompt_token_ids, w.output_len)
        for w in standard_workload(tokenizer, args.num_prompts, args.workload_seed)
    ]
    rng = np.random.default_rng(args.workload_seed + 1)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = np.array([t for t in range(len(tokenizer)) if t not in special])
    if args.shared_prefix:
        prefixes = [rng.choice(pool, size=args.shared_prefix).tolist()]
        prefixes += [
            rng.choice(pool, size=args.shared_prefix).tolist() for _ in range(args.num_prefixes - 1)
        ]
        # Its own generator: the one prefix (and long prompts) stay what they were without K.
        which = np.random.default_rng(args.workload_seed + 2).integers(
            len(prefixes), size=len(items)
        )
        items = [(prefixes[k] + p, n) for k, (p, n) in zip(which, items, strict=True)]
    if args.long_prompt_every:
        for i in range(0, len(items), args.long_prompt_every):
            items[i] = (rng.choice(pool, size=long_prompt_tokens(args)).tolist(), items[i][1])
    return items


async def _run_spawned(
    args: argparse.Namespace,
    toggles: list[str],
    workload: list[tuple[list[int], int]],
    concurrency: int,
    extra: dict[str, Any] | list[dict[str, Any]] | None = None,
) -> RunResult:
    async with spawned_server(args, toggles) as server:
        print(
            f"  server ready ({' '.join(toggles) or 'defaults'}), driving "
            f"{len(workload)} requests at concurrency {concurrency}"
            + (
                f" with {', '.join(extra[0] if isinstance(extra, list) else extra)}"
                if extra
                else ""
            ),
            file=sys.stderr,
        )
        return await drive(
            server.url, workload, concurrency, args.timeout, extra, server.processes()
        )


async def _structured_cost(
    args: argparse.Namespace, workload: list[tuple[list[int], int]]
) -> dict[str, Any]:
    """The workload plain, then with every request constrained to --json-schema."""
    with open(args.json_schema) as f:
        schema = json.load(f)

    def constraint(i: int) -> dict[str, Any]:
        own = schema
        if args.distinct_schemas:  # a property only this request may write: a new grammar
            own = {**schema, "properties": {**schema["properties"], f"r{i}": {"const": i}}}
        body = {"type": "json_schema", "json_schema": {"name": "bench", "schema": own}}
        return {"response_format": body}

    plain = await _run_spawned(args, [], workload, args.concurrency)
    extras = [constraint(i) for i in range(len(workload))]
    constrained = await _run_spawned(args, [], workload, args.concurrency, extras)
    return {
        **constrained.public(),
        "structured_outputs": {"plain": plain.public(), "json_schema": constrained.public()},
        "json_schema_ratio": constrained.output_tokens_per_s / plain.output_tokens_per_s,
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from kvfleet.runtime.models.tokenizer_loader import load_tokenizer, resolve_tokenizer

    # The prompts are token ids: they must come from the tokenizer the server will use.
    tokenizer = load_tokenizer(resolve_tokenizer(args.tokenizer) if args.tokenizer else args.model)
    workload = build_workload(args, tokenizer)
    result: dict[str, Any] = {"num_prompts": args.num_prompts, "workload_seed": args.workload_seed}
    runs: dict[str, RunResult] = {}  # label → run, for --plot

    async def pair(name: str, metric: str, on: list[str], off: list[str], conc: int) -> None:
        r_on = await _run_spawned(args, on, workload, conc)
        r_off = await _run_spawned(args, off, workload, conc)
        runs[f"{name.replace('_', ' ')} on"] = r_on
        runs[f"{name.replace('_', ' ')} off"] = r_off
        key = metric.split("_")[0]
        result.update(r_on.public())
        result[f"{metric}_on"] = getattr(r_on, metric)
        result[f"{metric}_off"] = getattr(r_off, metric)
        on_v = getattr(r_on, metric)
        result[f"{key}_ratio"] = getattr(r_off, metric) / on_v if on_v else None
        result[name] = {"on": r_on.public(), "off": r_off.public()}

    if args.replicas:
        from kvfleet.runtime.bench.serve_routing import run_routing

        result["shared_prefix_tokens"] = args.shared_prefix
        result.update(await run_routing(args, workload, spawned_server, drive))
        return result
    if args.shared_prefix:
        result["shared_prefix_tokens"] = args.shared_prefix
        await pair(
            "prefix_caching",
            "ttft_p50",
            ["--enable-prefix-caching"],
            ["--no-enable-prefix-caching"],
            SHARED_PREFIX_CONCURRENCY,
        )
    elif args.json_schema:
        result.update(await _structured_cost(args, workload))
    elif args.long_prompt_every:
        result["long_prompt_every"] = args.long_prompt_every
        result["long_prompt_tokens"] = long_prompt_tokens(args)
        await pair(
            "chunked_prefill",
            "itl_p99",
            ["--enable-chunked-prefill"],
            ["--no-enable-chunked-prefill"],
            args.concurrency,
        )
    elif args.concurrency_sweep:
        levels = [int(c) for c in args.concurrency_sweep.split(",")]
        async with spawned_server(args, []) as server:
            sweep = []
            for i, c in enumerate(levels):
                # Fresh prompts per level (same lengths' distribution): repeating them would
                # let prefix caching serve later levels from earlier ones.
                level_args = argparse.Namespace(
                    **{**vars(args), "workload_seed": args.workload_seed + i}
                )
                level_workload = build_workload(level_args, tokenizer)
                print(f"  concurrency {c}: {len(level_workload)} requests", file=sys.stderr)
                sweep.append(
                    await drive(
                        server.url, level_workload, c, args.timeout, None, server.processes()
                    )
                )
        result["sweep"] = [r.public() for r in sweep]
        if args.plot:
            from kvfleet.runtime.bench.plots import plot_concurrency_sweep

            plot_concurrency_sweep(sweep, args.plot)
        return result
    elif args.spawn:
        offline = []
        if args.offline_baseline:
            print("  offline baseline (bench throughput --baseline none)", file=sys.stderr)
            offline.append(await offline_throughput(args))
        served = await _run_spawned(args, [], workload, args.concurrency)
        runs[f"concurrency {args.concurrency}"] = served
        result.update(served.public())
        if args.offline_baseline:
            print("  offline baseline again", file=sys.stderr)
            offline.append(await offline_throughput(args))
            mean = sum(rate for rate, _ in offline) / len(offline)
            result["offline_output_tokens_per_s"] = mean
            result["offline_output_tokens_per_s_runs"] = [rate for rate, _ in offline]
            result["offline_cpu_seconds_runs"] = [cpu for _, cpu in offline]
            result["offline_ratio"] = served.output_tokens_per_s / mean
    else:
        run = await drive(args.url, workload, args.concurrency, args.timeout)
        runs[f"concurrency {args.concurrency}"] = run
        result.update(run.public())
    if args.plot:
        from kvfleet.runtime.bench.plots import plot_latency_cdfs

        plot_latency_cdfs(runs, args.plot)
    return result


def run(args: argparse.Namespace) -> int:
    import asyncio

    scenario = (
        args.shared_prefix or args.long_prompt_every or args.concurrency_sweep or args.json_schema
    )
    if (scenario or args.offline_baseline) and not args.spawn:
        print(
            "kvfleet bench serve: error: --shared-prefix, --long-prompt-every, "
            "--concurrency-sweep, --json-schema and --offline-baseline start their own servers "
            "and need --spawn",
            file=sys.stderr,
        )
        return 2
    if scenario and args.offline_baseline:
        print(
            "kvfleet bench serve: error: --offline-baseline compares plain serving only; "
            "leave out --shared-prefix, --long-prompt-every, --concurrency-sweep and "
            "--json-schema",
            file=sys.stderr,
        )
        return 2
    if args.distinct_schemas and not args.json_schema:
        print("kvfleet bench serve: error: --distinct-schemas needs --json-schema", file=sys.stderr)
        return 2
    if args.shared_prefix and args.long_prompt_every:
        print(
            "kvfleet bench serve: error: give one of --shared-prefix, --long-prompt-every",
            file=sys.stderr,
        )
        return 2
    if args.replicas and not (args.spawn and args.shared_prefix):
        print(
            "kvfleet bench serve: error: --replicas starts its own servers and compares "
            "routing on shared prefixes: it needs --spawn and --shared-prefix",
            file=sys.stderr,
        )
        return 2
    if args.replicas < 0 or args.num_prefixes < 1:
        print(
            "kvfleet bench serve: error: --replicas must be >= 0 and --num-prefixes >= 1",
            file=sys.stderr,
        )
        return 2
    if args.concurrency < 1 or args.num_prompts < 1:
        print(
            "kvfleet bench serve: error: --concurrency and --num-prompts must be >= 1",
            file=sys.stderr,
        )
        return 2
    result = asyncio.run(_main(args))
    text = json.dumps(result, indent=2)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    print(text)
    errors = result.get("errors") or sum(r["errors"] for r in result.get("sweep", []))
    return 1 if errors else 0
