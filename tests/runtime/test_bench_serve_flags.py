"""`kvfleet bench serve --spawn` starts servers (and offline baselines) with the engine flags it
was given: every one of them, so that what it measures is what was asked for."""

from __future__ import annotations

import argparse

from kvfleet.runtime.bench import serve, serve_spawn, throughput
from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.engine_args import SERVE_MAX_STEP_TIME_RATIO, engine_config_from_args
from kvfleet.runtime.server import cmd_serve


def _parse(register, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_the_spawned_server_gets_the_same_engine_config():
    flags = [
        "--model", "random:tiny", "--dtype", "float32", "--max-num-batched-tokens", "512",
        "--max-step-time-ratio", "0", "--no-enable-prefix-caching", "--num-threads", "1",
        "--long-prefill-token-threshold", "64", "--kernel-backend", "torch", "--no-allow-amx",
        "--enforce-eager", "--kv-cache-memory", "64MiB", "--stream-interval", "3",
    ]  # fmt: skip
    bench = _parse(serve.register, ["serve", *flags])
    forwarded = serve_spawn.engine_flags(bench)
    spawned = _parse(cmd_serve.register, ["serve", *forwarded])
    assert engine_config_from_args(spawned) == engine_config_from_args(bench)
    assert engine_config_from_args(bench).max_step_time_ratio == 0
    assert engine_config_from_args(spawned).stream_interval == 3


def test_defaults_are_left_to_the_server():
    assert serve_spawn.engine_flags(_parse(serve.register, ["serve"])) == ["--model", "bundled"]


def test_a_server_bounds_prompt_steps_by_default_and_offline_runs_do_not():
    """Streams someone reads keep flowing while prompts arrive; offline, prompts take the
    whole budget (nobody reads a stream there, and the bound costs throughput)."""
    served = engine_config_from_args(_parse(cmd_serve.register, ["serve"]))
    assert served.max_step_time_ratio == SERVE_MAX_STEP_TIME_RATIO > 1
    assert (
        engine_config_from_args(_parse(throughput.register, ["throughput"])).max_step_time_ratio
        == 0
    )
    assert EngineConfig().max_step_time_ratio == 0  # LLM(...)


def test_the_offline_baseline_schedules_as_the_server_does():
    for given in ([], ["--max-step-time-ratio", "0"], ["--max-step-time-ratio", "4"]):
        bench = _parse(serve.register, ["serve", *given])
        offline_flags = serve_spawn.engine_flags(bench, serving=False)
        offline = _parse(throughput.register, ["throughput", *offline_flags])
        spawned = _parse(cmd_serve.register, ["serve", *serve_spawn.engine_flags(bench)])
        assert engine_config_from_args(offline) == engine_config_from_args(spawned)
