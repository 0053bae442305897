"""`kvfleet bench startup`: how long `kvfleet serve` takes from launch to ready (`/health` 200),
to the first token of a completion sent the moment it is ready, and to exit after SIGTERM. A
replica scaled up from zero keeps its first request waiting for the first two.

With `--baseline-cmd` (any OpenAI-compatible server's command line, `{port}` where its port
goes: another install's `kvfleet serve`, `vllm serve`) the two start in turns, A B A B, and
each figure's ratio is taken pair by pair, so that a host whose speed drifts compares like
with like.

  kvfleet bench startup --model bundled --runs 5 \\
      --baseline-cmd '/old/venv/bin/kvfleet serve --model bundled --port {port}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

from kvfleet.runtime.bench.serve_spawn import engine_flags, healthy_process
from kvfleet.runtime.engine.engine_args import add_engine_args

POLL_S = 0.05  # how often /health is asked: the resolution of `ready_s`
FIGURES = ("ready_s", "first_token_s", "stop_s")


@dataclass(frozen=True, slots=True)
class StartupRun:
    """One start: seconds from launch to /health 200, from launch to the first streamed token,
    and from SIGTERM to exit."""

    ready_s: float
    first_token_s: float
    stop_s: float


class StartupError(RuntimeError):
    """A server that exited, never became ready, or did not answer its first request."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "startup",
        help="time from launching `kvfleet serve` to ready and to its first token",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=5, help="starts of each server (default 5)")
    p.add_argument(
        "--baseline-cmd",
        default=None,
        metavar="CMD",
        help="a server command to start in turns with kvfleet's, with {port} where its port "
        "goes (it must answer /health and /v1/completions on 127.0.0.1)",
    )
    p.add_argument(
        "--serve-args", default="", help="extra flags for `kvfleet serve`, as one string"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds allowed for one start (default 600)"
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    add_engine_args(p, serving=True)  # the flags of the server it starts
    p.set_defaults(func=run)


def kvfleet_argv(args: argparse.Namespace, port: int) -> list[str]:
    argv = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), *engine_flags(args), "--log-level", "warning"]
    return argv + shlex.split(args.serve_args)


def baseline_argv(command: str, port: int) -> list[str]:
    return shlex.split(command.replace("{port}", str(port)))


async def time_start(
    argv_for_port: Callable[[int], list[str]], what: str, timeout: float
) -> StartupRun:
    """Start the command on a free loopback port and time it to ready, to a first token and,
    after SIGTERM, to exit. StartupError, with the end of its log, where it fails."""
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        try:
            async with healthy_process(argv_for_port, what, timeout, POLL_S, log) as (url, _):
                ready = time.perf_counter() - start
                first_token = await asyncio.to_thread(_first_token, url, what) - start
                stopping = time.perf_counter()
        except RuntimeError as exc:  # healthy_process's, naming `what`, or _first_token's
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise StartupError(f"{exc}\n{tail}") from None
    return StartupRun(ready, first_token, time.perf_counter() - stopping)


def _first_token(url: str, what: str) -> float:
    """When the first streamed chunk of a one-token completion arrived."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as resp:
            model = json.load(resp)["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "stream": True}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    return time.perf_counter()
    except (urllib.error.URLError, OSError, ValueError, LookupError) as exc:
        raise StartupError(f"{what}: its first completion failed: {exc}") from None
    raise StartupError(f"{what}: its first completion streamed no chunk")


def summarize(runs: list[StartupRun], baseline: list[StartupRun]) -> dict[str, object]:
    """Each figure's median; with a baseline its medians and the median of the pairwise
    ratios (kvfleet ÷ baseline: below 1 is faster)."""
    result: dict[str, object] = {"runs": [asdict(r) for r in runs]}
    for name in FIGURES:
        result[f"{name}_median"] = statistics.median(getattr(r, name) for r in runs)
    if baseline:
        result["baseline_runs"] = [asdict(r) for r in baseline]
        for name in FIGURES:
            ours = [getattr(r, name) for r in runs]
            theirs = [getattr(r, name) for r in baseline]
            result[f"baseline_{name}_median"] = statistics.median(theirs)
            ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]
            result[f"{name}_ratio_median"] = statistics.median(ratios) if ratios else None
    return result


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        print(
            f"kvfleet bench startup: error: --runs must be >= 1, got {args.runs}", file=sys.stderr
        )
        return 2
    if args.baseline_cmd is not None and "{port}" not in args.baseline_cmd:
        print(
            "kvfleet bench startup: error: --baseline-cmd must contain {port}, where the "
            "baseline server's port goes",
            file=sys.stderr,
        )
        return 2
    runs: list[StartupRun] = []
    baseline: list[StartupRun] = []
    try:
        for i in range(args.runs):
            print(f"  start {i + 1}/{args.runs}", file=sys.stderr)
            start = time_start(partial(kvfleet_argv, args), "kvfleet serve", args.timeout)
            runs.append(asyncio.run(start))
            if args.baseline_cmd is not None:
                argv = partial(baseline_argv, args.baseline_cmd)
                baseline.append(asyncio.run(time_start(argv, "--baseline-cmd", args.timeout)))
    except RuntimeError as exc:
        print(f"kvfleet bench startup: error: {exc}", file=sys.stderr)
        return 1
    result = {"model": args.model, **summarize(runs, baseline)}
    text = json.dumps(result, indent=2)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
