"""`kvfleet demo autoscale`: watch the autoscaler work, on one machine, with real runtime pods.

Everything runs here (autoscale.py): the dev cluster's Kubernetes API server, the operator (kopf,
with the autoscaler), the kubelet simulator (each replica is a real `kvfleet serve` process on
its own 127.0.0.x address, serving `random:tiny`) and a request load in three phases — light,
heavy, light. One line per autoscaler poll shows queue, KV usage and replicas; at the end the
timeline is drawn (queue depth, KV usage, replicas over time) and optionally saved as JSON.

This module is imported whenever the `kvfleet` command builds its parser, in every image: it
imports nothing but the standard library until the demo runs. The demo needs a source checkout
(the API server serves its crds/) with the dev extra installed (`pip install -e '.[dev]'`:
kmock, the API server's validators, matplotlib for the plot).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Run the autoscaler end to end on this machine and draw what it did: an in-process Kubernetes
API server, the kvfleet operator, real `kvfleet serve` pods (random tiny model, one CPU
thread each, on 127.0.0.2, 127.0.0.3, ...) and a light → heavy → light request load. Prints a
line per autoscaler poll and writes the timeline plot. Needs a source checkout with the dev
extra installed (pip install -e '.[dev]')."""
INSTALL_HINT = "the demo needs a source checkout with the dev extra: pip install -e '.[dev]'"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `demo autoscale` to the kvfleet CLI."""
    demo = subparsers.add_parser(
        "demo",
        help="demonstrations that run on one machine",
        description="Demonstrations that run on one machine.",
    )
    sub = demo.add_subparsers(dest="demo", required=True, metavar="DEMO")
    p = sub.add_parser(
        "autoscale",
        help="scale real runtime pods on queue depth and KV usage, and plot it",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--duration",
        type=float,
        default=75.0,
        metavar="S",
        help="seconds of load once the first pod is ready (default 75; at least 30)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("autoscaling-timeline.png"),
        metavar="PNG",
        help="where to write the timeline plot (default autoscaling-timeline.png)",
    )
    p.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="also write the timeline as JSON"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every request succeeded and no pod crashed."""
    import asyncio
    import logging

    from kvfleet.devcluster import source_checkout

    if args.duration < 30:
        print("kvfleet demo autoscale: error: --duration must be >= 30 seconds", file=sys.stderr)
        return 2
    missing = ", ".join(str(path) for path in source_checkout.missing())
    if missing:
        print(
            f"kvfleet demo autoscale: error: {missing} not found\n({INSTALL_HINT})", file=sys.stderr
        )
        return 2
    try:
        import matplotlib  # noqa: F401
        from kvfleet.devcluster.demo.autoscale import autoscale
    except ImportError as exc:
        print(f"kvfleet demo autoscale: error: {exc}\n({INSTALL_HINT})", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("kopf", "aiohttp.access", "kvfleet.kubelet_sim", "kvfleet.autoscaler"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        return asyncio.run(autoscale(args))
    except KeyboardInterrupt:
        print("interrupted; every pod was stopped", file=sys.stderr)
        return 130
