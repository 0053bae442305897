"""`kvfleet operator`: run the InferenceService operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import os

from kvfleet.operator.spec import DEFAULT_IMAGE

from kvfleet import contract

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

DESCRIPTION = """\
Run the kvfleet operator: turn InferenceService objects into a Deployment and a Service,
keep their status conditions (Ready, Progressing, Degraded) current, and put back children
that are edited or deleted by hand.

Credentials come from the pod's service account in a cluster, else from KUBECONFIG.
Several replicas elect one active replica through kopf peering unless --standalone is given
(install manifests/peering.yaml for that)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `operator` subcommand to the kvfleet CLI."""
    p = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator for InferenceService objects",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="serve only this namespace (repeatable; glob patterns such as 'team-*' work)",
    )
    scope.add_argument(
        "--all-namespaces",
        "-A",
        action="store_true",
        help="serve every namespace (the default when no --namespace is given)",
    )
    p.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve a liveness endpoint at this URL, e.g. http://0.0.0.0:8081/healthz",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=contract.OPERATOR_METRICS_PORT,
        metavar="N",
        help=f"port of the operator's Prometheus /metrics; 0 disables it (default {contract.OPERATOR_METRICS_PORT})",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="do not take part in peering (leader election); for a single replica or local runs",
    )
    p.add_argument(
        "--peering",
        metavar="NAME",
        default="kvfleet",
        help="name of the (Cluster)KopfPeering object replicas elect a leader through (default kvfleet)",
    )
    p.add_argument(
        "--max-gpus-per-node",
        type=int,
        default=8,
        metavar="N",
        help="largest GPU count one node offers; a spec asking more per replica is Degraded (default 8)",
    )
    p.add_argument(
        "--default-runtime-image",
        metavar="IMAGE",
        default=os.environ.get("KVFLEET_DEFAULT_RUNTIME_IMAGE", DEFAULT_IMAGE),
        help="runtime image for InferenceServices that name none "
        f"(env KVFLEET_DEFAULT_RUNTIME_IMAGE; default {DEFAULT_IMAGE})",
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.upper,
        default=os.environ.get("KVFLEET_LOG_LEVEL", "INFO").upper(),
        help="log verbosity (env KVFLEET_LOG_LEVEL; default INFO)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="log every handler call (DEBUG)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted."""
    import asyncio
    import logging

    import kopf
    from kvfleet.operator import metrics
    from kvfleet.operator.handlers import OperatorConfig, build_registry

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    registry = build_registry(
        OperatorConfig(
            max_gpus_per_node=args.max_gpus_per_node,
            default_runtime_image=args.default_runtime_image,
        )
    )
    clusterwide = args.all_namespaces or not args.namespace
    asyncio.run(
        kopf.operator(
            registry=registry,
            clusterwide=clusterwide,
            namespaces=() if clusterwide else tuple(args.namespace),
            standalone=args.standalone,
            peering_name=args.peering,
            liveness_endpoint=args.liveness,
        )
    )
    return 0
