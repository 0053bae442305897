"""Thin kopf handlers: reconcile InferenceServices, keep children and status current.

All decisions live in pure modules (render, spec_check, status, apply); these functions fetch,
call them and write. Errors are classified on purpose: a spec that cannot be served is a
kopf.PermanentError (Degraded=True, no retries until the spec changes); conflicts, throttling
and server errors are kopf.TemporaryError (retried with a delay).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kvfleet.operator import conditions as c
from kvfleet.operator import metrics
from kvfleet.operator.apply import apply_child
from kvfleet.operator.apply_router import INFERENCE_POOL_MISSING, apply_router
from kvfleet.operator.autoscale_tasks import register_autoscaler
from kvfleet.operator.image_roll import DefaultImageRolls
from kvfleet.operator.kube_api import (
    DEPLOYMENTS,
    ISVCS,
    PDBS,
    PODS,
    SERVICES,
    KubeApi,
    KubeApiError,
)
from kvfleet.operator.lora_tasks import register_lora_sync
from kvfleet.operator.refresh_queue import RefreshQueue
from kvfleet.operator.render import (
    DEFAULT_CLUSTER_DOMAIN,
    MANAGED_BY,
    render_deployment,
    render_pdb,
    render_service,
    selector_string,
)
from kvfleet.operator.spec import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE, InferenceServiceSpec
from kvfleet.operator.spec_check import (
    DEFAULT_MAX_GPUS_PER_NODE,
    SpecProblem,
    check_spec,
)
from kvfleet.operator.status import compute_status

from kvfleet import contract

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
ANNOTATION_PREFIX = contract.API_GROUP  # kopf's bookkeeping annotations: kvfleet.dev/...
RETRY_DELAY_SECONDS = 5


@dataclass(slots=True)
class OperatorConfig:
    """What the handlers need beyond the objects: limits and, once started, the API client."""

    max_gpus_per_node: int = DEFAULT_MAX_GPUS_PER_NODE
    default_runtime_image: str = DEFAULT_IMAGE  # for specs that name no runtime image
    default_runtime_cpu_image: str = DEFAULT_CPU_IMAGE  # the same, for spec.resources.gpus 0
    # A changed default image reaches its services a few at a time (image_roll.py).
    rolls: DefaultImageRolls = field(default_factory=DefaultImageRolls)
    cluster_domain: str = DEFAULT_CLUSTER_DOMAIN  # status.url's DNS domain
    fixed_uid: bool = True  # pods run as the image's user; False: the platform assigns one
    api: KubeApi | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict, repr=False)

    def client(self) -> KubeApi:
        """The API client, created on first use from the environment."""
        if self.api is None:
            self.api = KubeApi.from_environment()
        return self.api

    def default_image(self, spec: InferenceServiceSpec) -> str:
        """The image for a spec that names none: the CPU build for a service without GPUs."""
        if spec.resources.gpus == 0:
            return self.default_runtime_cpu_image
        return self.default_runtime_image

    def reconciling(self, namespace: str, name: str) -> threading.Lock:
        """Held while one InferenceService is reconciled: its own changes and every child's
        events start reconciles, which kopf runs at once in its thread pool. Unserialised, one
        that read the Deployment before a change could write its status after one that read it
        since, and no event would come to correct it (controller-runtime's work queue gives the
        same one-at-a-time guarantee)."""
        return self.locks.setdefault((namespace, name), threading.Lock())


def _owner_name(child: Mapping[str, Any]) -> str | None:
    for ref in child.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == contract.KIND and ref.get("apiVersion", "").startswith(
            contract.API_GROUP + "/"
        ):
            return ref.get("name")
    return None


def _problem_message(problems: list[SpecProblem]) -> str:
    return "; ".join(f"{p.reason}: {p.message}" for p in problems)


def reconcile(config: OperatorConfig, isvc: Mapping[str, Any]) -> dict[str, Any]:
    """Apply the children for one InferenceService and return the status to write.

    Raises kopf.PermanentError for a spec that cannot be served (after the status says why) and
    kopf.TemporaryError for API failures worth retrying.
    """
    api = config.client()
    meta = isvc["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    domain = config.cluster_domain
    spec, problems = check_spec(
        isvc.get("spec") or {}, max_gpus_per_node=config.max_gpus_per_node, name=name
    )
    if problems or spec is None:
        deployment = api.get(DEPLOYMENTS, namespace, name)
        return compute_status(isvc, deployment, problems=problems, cluster_domain=domain)
    try:
        image = config.default_image(spec)
        if spec.runtime.image is None:
            default = image
            image = config.rolls.decide(
                (namespace, name), default, lambda: api.get(DEPLOYMENTS, namespace, name)
            )
            if image != default:  # held on its image until another service's roll ends
                config.rolls.requeue(namespace, name, config.rolls.retry_in())
        deployment = apply_child(
            api,
            DEPLOYMENTS,
            render_deployment(isvc, image, fixed_uid=config.fixed_uid),
            replicas_by_autoscaler=spec.autoscaling.enabled,
        )
        apply_child(api, SERVICES, render_service(isvc))
        pdb = render_pdb(isvc)
        if pdb is not None:
            apply_child(api, PDBS, pdb)
        elif api.get(PDBS, namespace, name) is not None:
            api.delete(PDBS, namespace, name)  # replicas went down to one, or it was switched off
        pods = api.list(PODS, namespace, selector_string(name))
        # The router runs from the runtime pods' image: on a CPU-only cluster that is the
        # CPU image (the GPU one may not even be pullable there), and it rolls with them.
        router = apply_router(api, isvc, spec, image, fixed_uid=config.fixed_uid)
    except KubeApiError as exc:
        metrics.RECONCILE_ERRORS.labels(reason=f"HTTP{exc.status}").inc()
        if exc.retryable:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_DELAY_SECONDS) from exc
        problem = SpecProblem("ApplyRejected", f"the API server rejected a child: {exc}")
        deployment = api.get(DEPLOYMENTS, namespace, name)
        return compute_status(isvc, deployment, problems=[problem], cluster_domain=domain)
    return compute_status(isvc, deployment, pods, cluster_domain=domain, router=router)


def refresh_from_child(config: OperatorConfig, namespace: str, name: str) -> None:
    """After a child changed: put back what drifted and bring the owner's status up to date."""
    api = config.client()
    with config.reconciling(namespace, name):
        isvc = api.get(ISVCS, namespace, name)  # read under the lock: the last write included
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            return  # being deleted: garbage collection removes the children
        with metrics.reconcile_timer("child"):
            # Deleted while we worked: the write finds nothing (anything just created is
            # collected with it).
            write_status(config, isvc, reconcile(config, isvc))


def write_status(config: OperatorConfig, isvc: Mapping[str, Any], status: dict[str, Any]) -> None:
    """Patch status only when it differs, so status writes cannot feed a watch loop.

    Preconditioned on the resourceVersion read: the autoscaler writes its AutoscalerReady
    condition into the same list, and a write based on an older read would erase it. On a
    conflict the object is read again and its conditions of other types kept under ours (the
    other writer is not another reconcile: OperatorConfig.reconciling)."""
    meta = isvc["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    metrics.observe_status(namespace, name, status)
    ours = [x for x in status.get("conditions") or [] if x.get("type") in c.CONDITION_TYPES]

    def compute(current: dict[str, Any]) -> dict[str, Any] | None:
        old = current.get("status") or {}
        theirs = [x for x in old.get("conditions") or [] if x.get("type") not in c.CONDITION_TYPES]
        new = {**status, "conditions": ours + theirs}
        if all(old.get(k) == v for k, v in new.items()):
            return None
        return {"status": new}

    outcome = config.client().patch_preconditioned(
        ISVCS, namespace, name, compute, sub="status", current=dict(isvc)
    )
    if outcome == "conflict":
        raise kopf.TemporaryError("status kept changing under the write; retrying", delay=1)


UNSERVABLE = frozenset(
    {
        "InvalidSpec",
        "UnsupportedModelURI",
        "InsufficientGPUs",
        "UnsupportedTensorParallel",
        "ApplyRejected",
    }
)


# Degraded reasons that an install elsewhere fixes (a missing CRD), not a spec change: the
# handler retries after API_RECHECK_SECONDS. While it waits, kopf holds the object's next spec
# change too (events of its children still reconcile it at once), so the delay stays short.
WAIT_FOR_API = frozenset({INFERENCE_POOL_MISSING})
API_RECHECK_SECONDS = 15


def _fail_if_unservable(status: Mapping[str, Any]) -> None:
    degraded = next(
        (x for x in status.get("conditions") or [] if x.get("type") == c.DEGRADED), None
    )
    if degraded and degraded.get("status") == "True" and degraded.get("reason") in UNSERVABLE:
        metrics.RECONCILE_ERRORS.labels(reason=degraded["reason"]).inc()
        # Permanent: retrying cannot help until the spec changes (which re-triggers us).
        raise kopf.PermanentError(f"{degraded['reason']}: {degraded.get('message', '')}")


def _retry_if_waiting_for_an_api(status: Mapping[str, Any]) -> None:
    degraded = next(
        (x for x in status.get("conditions") or [] if x.get("type") == c.DEGRADED), None
    )
    if degraded and degraded.get("status") == "True" and degraded.get("reason") in WAIT_FOR_API:
        # A CRD someone may install later: look again now and then, not in a tight loop.
        raise kopf.TemporaryError(degraded.get("message", ""), delay=API_RECHECK_SECONDS)


def build_registry(
    config: OperatorConfig | None = None, registry: kopf.OperatorRegistry | None = None
) -> kopf.OperatorRegistry:
    """A kopf registry holding the operator's handlers (an explicit one: tests run several)."""
    config = config or OperatorConfig()
    registry = registry or kopf.OperatorRegistry()
    # Owners whose children changed, reconciled with retries (refresh_queue.py).
    queue = RefreshQueue(functools.partial(refresh_from_child, config))
    config.rolls.requeue = queue.add

    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
        # An explicit registry has none of kopf's default login handlers. kopf's own
        # login_via_client reads KUBECONFIG as it was when `kubernetes` was imported; this
        # reuses KubeApi's configuration, read now, so both clients talk to the same server.
        cfg = config.client().api_client.configuration
        header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
            "authorization"
        )
        scheme, _, token = (header or "").rpartition(" ")
        return kopf.ConnectionInfo(
            server=cfg.host,
            ca_path=cfg.ssl_ca_cert,
            insecure=not cfg.verify_ssl,
            username=cfg.username or None,
            password=cfg.password or None,
            scheme=scheme or None,
            token=token or None,
            certificate_path=cfg.cert_file,
            private_key_path=cfg.key_file,
            trust_env=settings.networking.trust_env,
        )

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Bookkeeping in annotations: the status schema stays strict (no status.kopf field).
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=ANNOTATION_PREFIX
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{contract.API_GROUP}/finalizer"
        settings.posting.level = logging.WARNING  # an int: a string silently stops handlers
        settings.execution.max_workers = 8
        config.client()
        queue.start()

    @kopf.on.cleanup(registry=registry)
    def stop_refresh_queue(**_: Any) -> None:
        queue.stop()

    @kopf.on.resume(*ISVCS, registry=registry)
    @kopf.on.create(*ISVCS, registry=registry)
    @kopf.on.update(*ISVCS, registry=registry)
    def reconcile_isvc(body: kopf.Body, **_: Any) -> None:
        namespace, name = body.metadata["namespace"], body.metadata["name"]
        with config.reconciling(namespace, name), metrics.reconcile_timer("inferenceservice"):
            # Read under the lock, not kopf's body: that may predate the status another
            # reconcile wrote meanwhile, and status.router says which router children exist.
            isvc = config.client().get(ISVCS, namespace, name)
            if isvc is None or isvc["metadata"].get("deletionTimestamp"):
                return  # being deleted: garbage collection removes the children
            status = reconcile(config, isvc)
            # Written here rather than through kopf's handler patch, which is not preconditioned
            # and would erase an AutoscalerReady condition the autoscaler wrote meanwhile; before
            # the check below, so an unservable spec still shows why.
            write_status(config, isvc, status)
            _fail_if_unservable(status)
            _retry_if_waiting_for_an_api(status)

    # An event handler, not @kopf.on.delete: no handler here needs a finalizer, and without one
    # kopf calls deletion handlers only for objects that some other finalizer holds.
    @kopf.on.event(*ISVCS, registry=registry)
    def forget_isvc(type: str, body: kopf.Body, **_: Any) -> None:
        if type == "DELETED":
            namespace, name = body.metadata["namespace"], body.metadata["name"]
            metrics.forget(namespace, name)
            queue.forget(namespace, name)
            config.locks.pop((namespace, name), None)

    # A child's event queues its owner's reconcile (refresh_queue.py: retried until it
    # succeeds, one per burst of events) instead of running it in kopf's one-shot handler.
    @kopf.on.event("apps", "v1", "deployments", labels=MANAGED, registry=registry)
    def deployment_changed(type: str, body: kopf.Body, **_: Any) -> None:
        key = (body.metadata["namespace"], body.metadata["name"])
        config.rolls.observe(key, None if type == "DELETED" else body)
        owner = _owner_name(body)
        if owner:
            queue.add(body.metadata["namespace"], owner)

    @kopf.on.event("", "v1", "services", labels=MANAGED, registry=registry)
    def service_changed(body: kopf.Body, **_: Any) -> None:
        owner = _owner_name(body)
        if owner:
            queue.add(body.metadata["namespace"], owner)

    @kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry)
    def pod_changed(body: kopf.Body, **_: Any) -> None:
        # Pods are owned by ReplicaSets; the instance label names the InferenceService.
        name = (body.metadata.get("labels") or {}).get("app.kubernetes.io/instance")
        if name:
            queue.add(body.metadata["namespace"], name)

    register_autoscaler(registry, config)
    register_lora_sync(registry, config, queue.add)
    return registry
