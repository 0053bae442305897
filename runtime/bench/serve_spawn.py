"""The processes `kvfleet bench serve --spawn` starts: `kvfleet serve` on a free loopback port
with this command's engine flags, and `kvfleet bench throughput --baseline none` in a fresh
process for the offline baseline. Each is told the same engine flags, so the baseline schedules
as the server does."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import IO

from kvfleet.runtime.bench.process_cpu import descendants
from kvfleet.runtime.engine.engine_args import add_engine_args


def engine_flags(args: argparse.Namespace, serving: bool = True) -> list[str]:
    """The engine flags this command was given, for the processes it starts: every flag of
    `add_engine_args` whose value is not the started command's default (`serving`: `kvfleet
    serve`'s; a token stays in the environment, out of the process list)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser, serving)
    argv = ["--model", args.model]
    for action in parser._actions:  # argparse offers no public walk of its actions
        value = getattr(args, action.dest, action.default)
        if action.dest in ("model", "hf_token") or value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def serve_argv(args: argparse.Namespace, port: int, toggles: list[str]) -> list[str]:
    """`kvfleet serve` on `port` with this command's engine flags, then `toggles` and
    --serve-args."""
    argv = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), *engine_flags(args)]
    argv += ["--max-waiting-requests", str(max(args.num_prompts, 256)), "--log-level", "warning"]
    return argv + toggles + shlex.split(args.serve_args)


async def offline_throughput(args: argparse.Namespace) -> tuple[float, dict[str, float] | None]:
    """Output tokens/s of `kvfleet bench throughput --baseline none` in a fresh process, on
    this command's workload and engine flags, and the CPU seconds it used doing it."""
    import asyncio
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/offline.json"
        argv = [sys.executable, "-m", "kvfleet.runtime.cli", "bench", "throughput"]
        argv += ["--baseline", "none", "--num-prompts", str(args.num_prompts)]
        # The server's engine flags, its defaults included: the baseline schedules as it does.
        argv += ["--workload-seed", str(args.workload_seed), "--json", out]
        argv += engine_flags(args, serving=False)
        run = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"the offline baseline failed:\n{run.stderr[-2000:]}")
        with open(out) as f:
            offline = json.load(f)
        return float(offline["kvfleet_output_tokens_per_s"]), offline["kvfleet_cpu_seconds"]


@dataclass(frozen=True, slots=True)
class SpawnedServer:
    """A `kvfleet serve` this command started: where it answers, and its process id."""

    url: str
    pid: int

    def processes(self) -> dict[str, list[int]]:
        """The server and its children (the engine core, with any tensor-parallel workers),
        by role: the processes whose CPU seconds a run reports."""
        return {"server": [self.pid], "core": descendants(self.pid)}


@contextlib.asynccontextmanager
async def healthy_process(
    argv_for_port: Callable[[int], list[str]],
    what: str,
    timeout: float,
    poll: float,
    output: IO[bytes] | None = None,
) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """The command `argv_for_port(port)` on a free loopback port, once its /health answers 200
    (RuntimeError naming `what` if it exits or `timeout` seconds pass first); yields its URL
    and process, and stops it (SIGTERM, then kill) on exit. Its output goes to `output`
    where given, else to this process's."""
    import asyncio
    import socket

    import aiohttp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stderr = subprocess.STDOUT if output is not None else None
    proc = subprocess.Popen(argv_for_port(port), stdout=output, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what} exited {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} was not healthy within {timeout:g} s")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(poll)
        yield url, proc
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM (a server drains, then exits), then SIGKILL after `timeout` seconds; reaped."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.asynccontextmanager
async def spawned_server(
    args: argparse.Namespace, toggles: list[str]
) -> AsyncIterator[SpawnedServer]:
    """`kvfleet serve` with the engine flags (plus `toggles`) on a free loopback port, healthy;
    yields its URL and process id, and stops it on exit."""
    argv = functools.partial(serve_argv, args, toggles=toggles)
    async with healthy_process(argv, "the spawned server", 600, 0.5) as (url, proc):
        yield SpawnedServer(url, proc.pid)
