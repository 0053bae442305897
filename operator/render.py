"""Pure functions from an InferenceService to its children: a Deployment and a Service.

No I/O: the handlers apply what these return. Every spec field that reaches the pod is read
here, so the render tests cover the whole spec-to-pod mapping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvfleet.operator.image_roll import DEFAULT_IMAGE_ANNOTATION
from kvfleet.operator.model_cache import ModelCachePlan, plan_model_cache
from kvfleet.operator.model_uri import parse_model_uri
from kvfleet.operator.quantity import parse_bytes
from kvfleet.operator.render_lora import lora_args, lora_volumes, runtime_hub_env
from kvfleet.operator.render_pod_policy import (
    container_security_context,
    deployment_strategy,
    disruption_budget,
    pod_security_context,
    progress_deadline_seconds,
    runtime_probes,
)
from kvfleet.operator.spec import DEFAULT_IMAGE, InferenceServiceSpec, SecretKeyRef, parse_spec
from kvfleet.operator.spec_check import gpus_per_replica

from kvfleet import contract

MANAGED_BY = "kvfleet-operator"
APP_NAME = "kvfleet"
ROUTER_APP_NAME = "kvfleet-router"
COMPONENT = "inference"
CONTAINER_NAME = "runtime"
DOWNLOAD_CONTAINER_NAME = "model-download"
SERVICE_PORT = 80
# The Deployment carries the InferenceService generation it was rendered from, so the status
# logic can tell a Deployment that reflects the current spec from a stale one.
GENERATION_ANNOTATION = "kvfleet.dev/generation"
PRESTOP_SLEEP_SECONDS = 5  # lets endpoints controllers drop the pod before SIGTERM
GRACE_MARGIN_SECONDS = 15  # beyond preStop + drain, for the process to exit
CACHE_DIR = "/var/cache/kvfleet"  # compiled kernels, converted models; HF_HOME below it
HF_HOME = f"{CACHE_DIR}/huggingface"
# The cluster's DNS domain (the kubelet's --cluster-domain): Service names resolve under it.
DEFAULT_CLUSTER_DOMAIN = "cluster.local"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select an InferenceService's pods (immutable on a Deployment)."""
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": name}


def router_selector_labels(name: str) -> dict[str, str]:
    """The labels that select an InferenceService's router pods (render_router.py): their own
    app name, so nothing that selects the runtime pods ever counts a router pod."""
    return {"app.kubernetes.io/name": ROUTER_APP_NAME, "app.kubernetes.io/instance": name}


def common_labels(name: str) -> dict[str, str]:
    """Labels on every child the operator manages."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector_string(name: str) -> str:
    """The label selector as text, for status.selector (the scale subresource reads it)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def check_cluster_domain(domain: str) -> str:
    """The cluster DNS domain as written into URLs (no trailing dot); ValueError naming the
    rule when it is not a DNS name."""
    stripped = domain.strip().removesuffix(".")
    if len(stripped) > 253 or not _DNS_SUBDOMAIN.fullmatch(stripped):
        raise ValueError(
            f"cluster domain {domain!r}: must be a DNS name of lowercase letters, digits, '-' "
            "and '.', at most 253 characters (e.g. cluster.local)"
        )
    return stripped


def service_url(name: str, namespace: str, cluster_domain: str = DEFAULT_CLUSTER_DOMAIN) -> str:
    """The in-cluster URL of the InferenceService's Service (port 80, so no port in the URL)."""
    return f"http://{name}.{namespace}.svc.{cluster_domain}"


def served_name(spec: InferenceServiceSpec, name: str) -> str:
    """The model name clients put in `model`: spec.model.servedName, else the object's name."""
    return spec.model.served_name or name


def owner_reference(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """A controller ownerReference to the InferenceService, so deleting it deletes the child."""
    meta = isvc["metadata"]
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _flag(name: str, enabled: bool) -> str:
    return f"--{name}" if enabled else f"--no-{name}"


def runtime_args(spec: InferenceServiceSpec, name: str) -> list[str]:
    """The `kvfleet serve` command line for this spec (without the leading `kvfleet`)."""
    source = parse_model_uri(spec.model.uri)
    rt = spec.runtime
    args = ["serve", "--model", source.model_arg]
    if source.revision:
        args += ["--revision", source.revision]
    args += [
        "--host", "0.0.0.0",
        "--port", str(contract.RUNTIME_PORT),
        "--served-model-name", served_name(spec, name),
        "--dtype", rt.dtype,
        "--block-size", str(rt.block_size),
        "--max-num-seqs", str(rt.max_num_seqs),
        "--max-num-batched-tokens", str(rt.max_num_batched_tokens),
        "--max-model-len", str(rt.max_model_len),
        "--kv-cache-memory-fraction", repr(rt.kv_cache_memory_fraction),
        _flag("enable-prefix-caching", rt.enable_prefix_caching),
        _flag("enable-chunked-prefill", rt.enable_chunked_prefill),
        "--drain-timeout", str(rt.drain_timeout_seconds),
    ]  # fmt: skip
    if rt.tensor_parallel_size > 1:  # only then: templates of one-rank services stay as they were
        args += ["--tensor-parallel-size", str(rt.tensor_parallel_size)]
    if spec.model.quantization is not None:  # likewise: unset, the checkpoint decides
        args += ["--quantization", spec.model.quantization]
    return args + lora_args(spec) + list(rt.extra_args)


def download_args(spec: InferenceServiceSpec) -> list[str]:
    """The `kvfleet download` command line of the init container (hf:// models)."""
    source = parse_model_uri(spec.model.uri)
    args = ["download", "--model", source.model_arg]
    if source.revision:
        args += ["--revision", source.revision]
    return args


def secret_env(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    """An environment variable read from a key of a Secret."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _env(spec: InferenceServiceSpec, plan: ModelCachePlan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": HF_HOME}]
    if spec.api_key_secret_ref is not None:
        env.append(secret_env(contract.API_KEY_ENV, spec.api_key_secret_ref))
    env += runtime_hub_env(spec, plan)  # offline, unless LoRA adapters come from the Hub
    # User entries come last so that they can override ours (Kubernetes keeps the last one).
    env.extend(dict(e) for e in spec.env)
    return env


def _download_env(spec: InferenceServiceSpec, plan: ModelCachePlan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": HF_HOME}]
    if plan.ephemeral_storage and not plan.pvc:
        # The emptyDir reports the node's free disk; its sizeLimit is what really bounds it.
        limit = str(parse_bytes(plan.ephemeral_storage))
        env.append({"name": contract.CACHE_LIMIT_ENV, "value": limit})
    if spec.model.hf_token_secret_ref is not None:
        env.append(secret_env("HF_TOKEN", spec.model.hf_token_secret_ref))
    # The user's variables (HF_ENDPOINT, proxies, HF_HUB_ENABLE_HF_TRANSFER...) reach the
    # download too, and may override ours.
    env.extend(dict(e) for e in spec.env)
    return env


def _resources(
    spec: InferenceServiceSpec, plan: ModelCachePlan, gpus: bool = True
) -> dict[str, Any]:
    requests: dict[str, str] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    limits: dict[str, str] = {"memory": spec.resources.memory}
    # Requested, not limited: an hf:// cache's emptyDir sizeLimit bounds the cache itself.
    storage = spec.resources.ephemeral_storage or plan.ephemeral_storage
    if storage:
        requests["ephemeral-storage"] = storage
    if gpus and gpus_per_replica(spec) > 0:
        # Extended resources must have requests == limits. One GPU per tensor-parallel rank.
        requests[spec.resources.gpu_resource_name] = str(gpus_per_replica(spec))
        limits[spec.resources.gpu_resource_name] = str(gpus_per_replica(spec))
    return {"requests": requests, "limits": limits}


def _volumes(
    spec: InferenceServiceSpec, plan: ModelCachePlan
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    source = parse_model_uri(spec.model.uri)
    cache: dict[str, Any] = {}
    if plan.ephemeral_storage:
        cache["sizeLimit"] = plan.ephemeral_storage
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.resources.shm_size:
        shm["sizeLimit"] = spec.resources.shm_size
    volumes: list[dict[str, Any]] = [
        # PyTorch and NCCL use shared memory well beyond the container runtime's 64 MiB default.
        {"name": "dshm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": cache},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    if plan.pvc:
        # Only HF_HOME is shared: compiled kernels stay per pod, in the emptyDir around it.
        # `readOnly: false` is never written: the API server drops it, and apply would see drift.
        claim: dict[str, Any] = {"claimName": plan.pvc}
        mount: dict[str, Any] = {"name": "hf-cache", "mountPath": HF_HOME}
        if plan.read_only:
            claim["readOnly"] = mount["readOnly"] = True
        volumes.append({"name": "hf-cache", "persistentVolumeClaim": claim})
        mounts.append(mount)
    if source.pvc_claim:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": source.pvc_claim, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": source.mount_path, "readOnly": True})
    lora_vols, lora_mounts = lora_volumes(spec)
    volumes += lora_vols
    mounts += lora_mounts
    # The user's extra volumes come last; the CRD keeps their names and paths off ours.
    volumes += [dict(v) for v in spec.volumes]
    mounts += [dict(m) for m in spec.volume_mounts]
    return volumes, mounts


def pod_template(
    spec: InferenceServiceSpec,
    name: str,
    default_image: str = DEFAULT_IMAGE,
    *,
    fixed_uid: bool = True,
) -> dict[str, Any]:
    """The pod template: the runtime container (after the model download for hf:// models),
    probes, volumes, scheduling and security (`fixed_uid`: render_pod_policy.py)."""
    plan = plan_model_cache(spec.model, parse_model_uri(spec.model.uri))
    volumes, mounts = _volumes(spec, plan)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(contract.RUNTIME_PORT),
        "prometheus.io/path": contract.METRICS_PATH,
        **spec.pod_annotations,
    }
    # User labels first: they may add labels but never change the ones the selector relies on.
    labels = {**spec.pod_labels, **common_labels(name)}
    grace = PRESTOP_SLEEP_SECONDS + spec.runtime.drain_timeout_seconds + GRACE_MARGIN_SECONDS
    image = spec.runtime.image or default_image
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["kvfleet"],
        "args": runtime_args(spec, name),
        "ports": [{"name": "http", "containerPort": contract.RUNTIME_PORT, "protocol": "TCP"}],
        "env": _env(spec, plan),
        "resources": _resources(spec, plan),
        **runtime_probes(spec),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        # A refusal at start (a tensorParallelSize the model's heads cannot take, a bad model)
        # becomes the termination message, which the Degraded condition quotes.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(spec, fixed_uid=fixed_uid),
    }
    if plan.download:
        pod_spec["initContainers"] = [
            {
                "name": DOWNLOAD_CONTAINER_NAME,
                "image": image,
                "imagePullPolicy": spec.runtime.image_pull_policy,
                "command": ["kvfleet"],
                "args": download_args(spec),
                "env": _download_env(spec, plan),
                # The memory of the runtime is plenty for a download; no GPU to hold idle.
                "resources": _resources(spec, plan, gpus=False),
                "volumeMounts": [m for m in mounts if m["name"] in ("tmp", "cache", "hf-cache")],
                "securityContext": container_security_context(),
                # The download's own error (repo not found, token missing) becomes the
                # container's termination message, which the status reports.
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ]
    _scheduling_and_identity(spec, pod_spec)
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def _scheduling_and_identity(spec: InferenceServiceSpec, pod_spec: dict[str, Any]) -> None:
    """The pod-spec fields copied from the InferenceService as written."""
    # The runtime never calls the Kubernetes API: no token in the pod unless asked for.
    pod_spec["automountServiceAccountToken"] = spec.automount_service_account_token
    optional: dict[str, Any] = {
        "nodeSelector": dict(spec.node_selector),
        "tolerations": [dict(t) for t in spec.tolerations],
        "affinity": dict(spec.affinity),
        "imagePullSecrets": [{"name": n} for n in spec.image_pull_secrets],
        "serviceAccountName": spec.service_account_name,
        "priorityClassName": spec.priority_class_name,
        "runtimeClassName": spec.runtime_class_name,
        "topologySpreadConstraints": [dict(c) for c in spec.topology_spread_constraints],
    }
    pod_spec.update({k: v for k, v in optional.items() if v})


def initial_replicas(spec: InferenceServiceSpec) -> int:
    """Replicas for a new Deployment: the autoscaler's floor when it owns them, else spec.replicas.

    A scale-to-zero service (minReplicas 0) still starts with one replica: a new service that
    answers shows it works, and it goes to zero once idle for scaleToZeroAfterSeconds."""
    if spec.autoscaling.enabled:
        return max(1, spec.autoscaling.min_replicas)
    return spec.replicas


def render_deployment(
    isvc: Mapping[str, Any], default_image: str = DEFAULT_IMAGE, *, fixed_uid: bool = True
) -> dict[str, Any]:
    """The Deployment for an InferenceService object (metadata with uid, generation; spec);
    `default_image` runs when the spec names no runtime image; `fixed_uid` False leaves the
    pods' UID and GID to the platform."""
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    spec = parse_spec(isvc.get("spec") or {})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": common_labels(name),
            "annotations": {
                GENERATION_ANNOTATION: str(meta.get("generation", 0)),
                # The operator's default image rolls a few services at a time (image_roll.py).
                **({DEFAULT_IMAGE_ANNOTATION: default_image} if spec.runtime.image is None else {}),
            },
            "ownerReferences": [owner_reference(isvc)],
        },
        "spec": {
            "replicas": initial_replicas(spec),
            "selector": {"matchLabels": selector_labels(name)},
            # By default surge, never drop: a replica serves until its successor is ready.
            "strategy": deployment_strategy(spec),
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": progress_deadline_seconds(spec),
            "template": pod_template(spec, name, default_image, fixed_uid=fixed_uid),
        },
    }


def render_pdb(isvc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The PodDisruptionBudget over the runtime pods (by default one eviction at a time, for
    an InferenceService that may run more than one replica); None when it has none."""
    bound = disruption_budget(parse_spec(isvc.get("spec") or {}))
    if bound is None:
        return None
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": common_labels(name),
            "ownerReferences": [owner_reference(isvc)],
        },
        "spec": {**bound, "selector": {"matchLabels": selector_labels(name)}},
    }


def render_service(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The ClusterIP Service clients use: port 80 to the runtime's port on ready pods, or to
    the kvfleet router's pods while `spec.router` runs one (the URL stays the same)."""
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    routed = parse_spec(isvc.get("spec") or {}).router.kvfleet
    selector = router_selector_labels(name) if routed else selector_labels(name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": common_labels(name),
            "ownerReferences": [owner_reference(isvc)],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
