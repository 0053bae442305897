"""`kvfleet serve`: the OpenAI-compatible server every runtime pod runs.

Lifecycle: the HTTP port opens first (so /health answers 503 while the model loads), the
engine core loads in its own process and passes a short warm-up generation, then /health turns
200. SIGTERM (or SIGINT) drains: /health 503, new requests 503, in-flight requests finish within
--drain-timeout, then the core stops, exit 0. Should the core fail (a fault no single request can
be blamed for, or the process killed), in-flight streams end with an error event, /health turns
503 and the process exits 1, so that Kubernetes (or any supervisor) restarts it rather than
leaving a pod that answers 503.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvfleet.runtime.engine.config import ConfigError
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args
from kvfleet.runtime.server.tool_calls.parsers import TOOL_CALL_PARSERS
from kvfleet.runtime.server.vllm_flags import (
    add_vllm_flags,
    ignored_flags,
    unsupported_message,
    vllm_flags_given,
)

from kvfleet import contract

log = logging.getLogger("kvfleet.serve")

DEFAULT_MAX_BODY_BYTES = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API with "
        "Prometheus metrics, a deep health check and a graceful drain.",
    )
    add_serve_args(p)
    add_engine_args(p, serving=True)
    add_vllm_flags(p)  # last: only the vLLM flags kvfleet does not have already
    p.set_defaults(func=run)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=contract.RUNTIME_PORT, help="port to listen on")
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' on the API (default: "
        f"${contract.API_KEY_ENV}; an empty key is an error); /health, /metrics, /version "
        f"and /openapi.json stay open",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests allowed to queue before new ones get 503 + Retry-After",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted (413 beyond)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when tools are given): the model decides '
        "whether to call, and --tool-call-parser reads its calls",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="the model family's tool-call format: hermes (Hermes, Qwen2.5/3), llama3_json "
        "(Llama 3.x), mistral",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve from the start (with --enable-lora), each name=path where "
        'path is a PEFT folder or hf://org/repo[@revision], or {"name": ..., "path": ...}',
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity",
    )


def _check_serve_args(args: argparse.Namespace) -> None:
    given = vllm_flags_given(args)
    if message := unsupported_message(given):
        raise ConfigError(message)
    for ignored in ignored_flags(given):
        log.info("ignoring vLLM's %s", ignored)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"port: must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests < 1:
        raise ConfigError(f"max_waiting_requests: must be >= 1, got {args.max_waiting_requests}")
    if args.drain_timeout < 0:
        raise ConfigError(f"drain_timeout: must be >= 0 seconds, got {args.drain_timeout}")
    if args.max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes: must be >= 1, got {args.max_body_bytes}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError(
            "tool_call_parser: --enable-auto-tool-choice needs --tool-call-parser (choose one "
            f"of {', '.join(sorted(TOOL_CALL_PARSERS))})"
        )
    from kvfleet.runtime.server.lora_adapters import parse_lora_modules

    try:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.lora_modules and not args.enable_lora:
        raise ConfigError("lora_modules: adapters need --enable-lora")


def api_key(args: argparse.Namespace) -> str | None:
    """The key the API requires, or None for none. An empty key is refused rather than taken
    to mean "no authentication": it is what a Secret with a missing value gives."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ConfigError("api_key: --api-key is empty; omit it to serve without a key")
        return args.api_key
    key = os.environ.get(contract.API_KEY_ENV)
    if key is not None and not key.strip():
        raise ConfigError(
            f"api_key: ${contract.API_KEY_ENV} is set but empty; unset it to serve without a key"
        )
    return key


def run(args: argparse.Namespace) -> int:
    import asyncio

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        _check_serve_args(args)
        key = api_key(args)
        config = engine_config_from_args(args)
    except ConfigError as exc:
        print(f"kvfleet serve: error: {exc}", file=sys.stderr)
        return 2
    from kvfleet.runtime.cmd_doctor import serving_problem

    # Said here in one line, before the model loads, rather than as a traceback from the first
    # kernel launch: the line a pod's termination message and Degraded condition carry.
    if problem := serving_problem(config.device, config.kernel_policy.backend):
        print(
            f"kvfleet serve: error: cannot serve on {config.device}: {problem} "
            "(`kvfleet doctor` reports the whole machine)",
            file=sys.stderr,
        )
        return 1
    code = asyncio.run(_serve(args, config, key))
    # Everything is stopped and its last words logged: skip the interpreter's teardown of
    # torch's, xgrammar's and transformers' modules (half a second on 2 cores of every stop).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(args: argparse.Namespace, config: object, key: str | None) -> int:
    import asyncio
    import contextlib
    import signal

    from aiohttp import web
    from kvfleet.runtime.engine.async_engine import AsyncEngine
    from kvfleet.runtime.engine.served_name import served_model_name
    from kvfleet.runtime.server.app import OpenAIServer, ServerSettings
    from kvfleet.runtime.server.http_runner import OpenAIAppRunner
    from kvfleet.runtime.server.metrics import RuntimeMetrics, cache_config_labels

    name = served_model_name(config)  # type: ignore[arg-type]
    engine: AsyncEngine
    metrics = RuntimeMetrics(name, lambda: engine.stats, lambda: cache_config_labels(engine))
    engine = AsyncEngine(config, observer=metrics)  # type: ignore[arg-type]
    settings = ServerSettings(
        model_name=name,
        api_key=key,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
        auto_tool_choice=args.enable_auto_tool_choice,
        enable_lora=config.enable_lora,  # type: ignore[attr-defined]
    )
    server = OpenAIServer(engine, metrics, settings)
    if settings.enable_lora:
        from kvfleet.runtime.server.lora_metrics import LoraCollector

        max_loras = config.max_loras  # type: ignore[attr-defined]
        metrics.registry.register(
            LoraCollector(max_loras, server.loras.names, lambda: engine.stats)
        )
    runner = OpenAIAppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, shutdown_timeout=5.0)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, exc)
        await runner.cleanup()
        return 1
    log.info(
        "listening on http://%s:%s (model %s%s; /health is 503 until it is loaded)",
        args.host,
        args.port,
        config.model,  # type: ignore[attr-defined]
        f" @ {args.revision}" if args.revision else "",
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    start = asyncio.create_task(engine.start())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # signalled while loading: nothing in flight, just leave
        log.info("stopping before the model finished loading")
        start.cancel()  # kills the loading core
        with contextlib.suppress(asyncio.CancelledError):
            await start
        await runner.cleanup()
        return 0
    if start.exception() is not None:
        log.error("could not load the model: %s", start.exception())
        await runner.cleanup()
        return 1

    # engine.start() returned after the core's warm-up generation passed (prefill, decode,
    # sampling) and the tokenizer loaded; --lora-modules' adapters load before the pod is
    # ready: a request naming one must not be a 404.
    for lora_name, source in args.lora_modules:
        try:
            await server.loras.load(lora_name, source)
        except Exception as exc:
            log.error("--lora-modules %s=%s: %s", lora_name, source, exc)
            await engine.stop()
            await runner.cleanup()
            return 1
    server.ready = True
    log.info("ready: serving %r on http://%s:%s", name, args.host, args.port)

    crashed = asyncio.create_task(engine.crashed.wait())
    await asyncio.wait({stopper, crashed}, return_when=asyncio.FIRST_COMPLETED)
    if crashed.done():
        log.critical("the engine stopped; exiting so that the process is restarted")
        # The streams already got their error event; give their last writes a moment.
        await server.wait_idle(5.0)
        await engine.stop()
        await runner.cleanup()
        return 1
    crashed.cancel()
    server.draining = True
    log.info(
        "draining: %d requests in flight, up to %.0f s", engine.num_in_flight, args.drain_timeout
    )
    if not await server.wait_idle(args.drain_timeout):
        log.warning("drain timeout: aborting %d requests still in flight", engine.num_in_flight)
    await engine.stop()
    await runner.cleanup()
    log.info("stopped")
    return 0
