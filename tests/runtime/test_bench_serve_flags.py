"""`kvfleet bench serve --spawn` starts servers (and offline baselines) with the engine flags it
was given: every one of them, so that what it measures is what was asked for."""

from __future__ import annotations

import argparse

from kvfleet.runtime.bench import serve
from kvfleet.runtime.engine.config import engine_config_from_args
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
        "--enforce-eager", "--kv-cache-memory", "64MiB",
    ]  # fmt: skip
    bench = _parse(serve.register, ["serve", *flags])
    forwarded = serve._engine_flags(bench)
    spawned = _parse(cmd_serve.register, ["serve", *forwarded])
    assert engine_config_from_args(spawned) == engine_config_from_args(bench)
    assert engine_config_from_args(bench).max_step_time_ratio == 0


def test_defaults_are_left_to_the_server():
    assert serve._engine_flags(_parse(serve.register, ["serve"])) == ["--model", "bundled"]
