"""The `kvfleet` console script.

Each subcommand lives in its own module exposing `register(subparsers)`; those modules import
torch, kopf etc. only inside the function that runs the command, so `kvfleet operator --help`
never loads torch and `kvfleet generate --help` never loads kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvfleet import __version__

# (module, why it is separate): order is the order shown in --help.
COMMAND_MODULES = (
    "kvfleet.runtime.cmd_generate",
    "kvfleet.runtime.cmd_download",
    "kvfleet.runtime.server.cmd_serve",
    "kvfleet.runtime.cmd_doctor",
    "kvfleet.runtime.router.cmd_router",
    "kvfleet.runtime.bench.cmd_bench",
    "kvfleet.operator.cmd_operator",
    "kvfleet.devcluster.demo.cmd_demo",
)


def register_commands(sub: argparse._SubParsersAction, modules: tuple[str, ...]) -> None:
    """Call each command module's `register(sub)`."""
    for name in modules:
        importlib.import_module(name).register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet",
        description="Run large language models: a paged-attention engine and its Kubernetes operator.",
    )
    parser.add_argument("--version", action="version", version=f"kvfleet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_commands(sub, COMMAND_MODULES)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
