"""`kvfleet operator`: run the InferenceService operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import os

from kvfleet.operator.image_roll import DEFAULT_MAX_ROLLS, DefaultImageRolls
from kvfleet.operator.leader_election import LeaseTiming
from kvfleet.operator.render import DEFAULT_CLUSTER_DOMAIN, check_cluster_domain
from kvfleet.operator.spec import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE

from kvfleet import contract

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

DESCRIPTION = """\
Run the kvfleet operator: turn InferenceService objects into a Deployment and a Service,
keep their status conditions (Ready, Progressing, Degraded) current, and put back children
that are edited or deleted by hand.

Credentials come from the pod's service account in a cluster, else from KUBECONFIG.
Replicas elect one active replica through a coordination.k8s.io Lease (as controller-runtime
does): only the holder runs the handlers and the autoscaler, the others wait to take over.
--standalone skips the election (one replica run by hand, or local runs)."""

# A pod's namespace when the Downward API does not say it (POD_NAMESPACE).
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


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
        help="act without leader election; only where a single operator runs (local runs)",
    )
    p.add_argument(
        "--lease-name",
        metavar="NAME",
        default="kvfleet-operator",
        help="name of the Lease replicas elect the active one through (default kvfleet-operator)",
    )
    p.add_argument(
        "--lease-namespace",
        metavar="NS",
        default=None,
        help="namespace of that Lease (default: env POD_NAMESPACE, else the pod's own "
        "namespace, else 'default')",
    )
    defaults = LeaseTiming()
    p.add_argument(
        "--lease-duration",
        type=int,
        default=defaults.lease_duration,
        metavar="S",
        help="seconds a standby waits on a Lease nobody renews before taking it "
        f"(default {defaults.lease_duration})",
    )
    p.add_argument(
        "--renew-deadline",
        type=float,
        default=defaults.renew_deadline,
        metavar="S",
        help="seconds the active replica keeps acting without a successful renewal; then it "
        f"exits (default {defaults.renew_deadline:g}; must be < --lease-duration)",
    )
    p.add_argument(
        "--retry-period",
        type=float,
        default=defaults.retry_period,
        metavar="S",
        help=f"seconds between tries to take or renew the Lease (default {defaults.retry_period:g})",
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
        "--default-runtime-cpu-image",
        metavar="IMAGE",
        default=os.environ.get("KVFLEET_DEFAULT_RUNTIME_CPU_IMAGE", DEFAULT_CPU_IMAGE),
        help="runtime image for InferenceServices that name none and ask for no GPU "
        f"(env KVFLEET_DEFAULT_RUNTIME_CPU_IMAGE; default {DEFAULT_CPU_IMAGE})",
    )
    p.add_argument(
        "--max-default-image-rolls",
        metavar="N",
        type=_at_least_one,
        default=os.environ.get("KVFLEET_MAX_DEFAULT_IMAGE_ROLLS", str(DEFAULT_MAX_ROLLS)),
        help="when a default runtime image changes, how many of the services using it roll to "
        "it at once; the next starts when one is ready (env KVFLEET_MAX_DEFAULT_IMAGE_ROLLS; "
        f"default {DEFAULT_MAX_ROLLS})",
    )
    p.add_argument(
        "--cluster-domain",
        metavar="DOMAIN",
        type=_cluster_domain,
        default=os.environ.get("KVFLEET_CLUSTER_DOMAIN", DEFAULT_CLUSTER_DOMAIN),
        help="the cluster's DNS domain, for the Service URL in status.url "
        f"(env KVFLEET_CLUSTER_DOMAIN; default {DEFAULT_CLUSTER_DOMAIN})",
    )
    p.add_argument(
        "--fixed-uid",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("KVFLEET_FIXED_UID", "true").lower() not in ("false", "0", "no"),
        help="run the pods it renders as the images' user, uid and gid "
        f"{contract.KVFLEET_UID}; --no-fixed-uid sets neither, for platforms that assign "
        "them, such as OpenShift (env KVFLEET_FIXED_UID; default true)",
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


def _cluster_domain(value: str) -> str:
    try:
        return check_cluster_domain(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _at_least_one(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return number


def lease_namespace(args: argparse.Namespace) -> str:
    """Where the Lease lives: the flag, else the operator's own namespace."""
    if args.lease_namespace:
        return args.lease_namespace
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def own_identity() -> str:
    """Unique per process, like controller-runtime's hostname_uuid: a restarted container in
    the same pod is a new candidate, not the old holder. Also kopf's identity, which spares
    kopf's getpass.getuser() (it fails for a uid without a passwd entry)."""
    import socket
    import uuid

    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4()}"


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted."""
    import asyncio
    import logging

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    timing = LeaseTiming(args.lease_duration, args.renew_deadline, args.retry_period)
    try:
        timing.check()
    except ValueError as exc:
        raise SystemExit(f"kvfleet operator: {exc}") from None
    asyncio.run(_serve(args, timing))
    return 0


async def _serve(args: argparse.Namespace, timing: LeaseTiming) -> None:
    import logging

    import kopf
    from kvfleet.operator import metrics
    from kvfleet.operator.handlers import OperatorConfig, build_registry
    from kvfleet.operator.kube_api import KubeApi
    from kvfleet.operator.leader_election import LeaderElector, run_while_leader
    from kvfleet.operator.liveness import serve_liveness

    if args.metrics_port:
        metrics.serve(args.metrics_port)
    liveness = await serve_liveness(args.liveness) if args.liveness else None
    identity = own_identity()
    registry = build_registry(
        OperatorConfig(
            max_gpus_per_node=args.max_gpus_per_node,
            default_runtime_image=args.default_runtime_image,
            default_runtime_cpu_image=args.default_runtime_cpu_image,
            rolls=DefaultImageRolls(args.max_default_image_rolls),
            cluster_domain=args.cluster_domain,
            fixed_uid=args.fixed_uid,
        )
    )
    clusterwide = args.all_namespaces or not args.namespace

    async def operate() -> None:
        # kopf never peers: the Lease decides who runs, and only the holder runs kopf at all.
        await kopf.operator(
            registry=registry,
            clusterwide=clusterwide,
            namespaces=() if clusterwide else tuple(args.namespace),
            standalone=True,
            identity=identity,  # kopf.Identity is a NewType of str
        )

    def lost() -> None:
        # Exit before anything else can run, as controller-runtime does: a replica that may no
        # longer hold the lease must not write one more object. The restarted container waits
        # as a standby.
        logging.getLogger("kvfleet.leader").critical("lost the lease: exiting")
        logging.shutdown()
        os._exit(1)

    try:
        if args.standalone:
            await operate()
        else:
            elector = LeaderElector(
                KubeApi.from_environment(), lease_namespace(args), args.lease_name, identity, timing
            )
            await run_while_leader(elector, operate, lost)
    finally:
        if liveness is not None:
            await liveness.cleanup()
