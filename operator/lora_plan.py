"""Which adapters to unload and load on one pod: a pure function of what spec.loras wants, what
the pod's runtime lists (GET /v1/models) and what the operator itself loaded there.

A pod is only worked on once it can take adapters: ready, with an IP, its runtime started with
--enable-lora (while the pods roll out to the first adapter, the old ones would refuse every
load), and, for a pvc:// adapter, the claim mounted (the rollout that adds its volume may still
be under way: until then that adapter waits on that pod rather than counting as refused).

Every adapter the pod has that spec.loras does not list, or lists from another source, is
unloaded: spec.loras is the whole list, as a Deployment's template is the whole pod.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.lora_spec import LoraSpec, lora_path
from kvfleet.operator.model_uri import MODELS_MOUNT_ROOT, parse_model_uri
from kvfleet.operator.render import CONTAINER_NAME

ENABLE_FLAG = "--enable-lora"
# A refused load is tried again after this, doubling per refusal up to the cap: the files may
# be fixed in place (a claim filled, a Hub repo pushed to) without the spec changing. A spec
# change tries again at once.
REFUSED_RETRY_SECONDS = 60.0
REFUSED_RETRY_MAX_SECONDS = 900.0


@dataclass(slots=True, frozen=True)
class LoraPod:
    """A pod as far as its adapters go."""

    name: str
    uid: str
    ip: str
    lora_enabled: bool  # its runtime runs with --enable-lora
    claims: frozenset[str]  # the claims mounted at /models/<claim> in its runtime container


@dataclass(slots=True, frozen=True)
class Wanted:
    """An adapter of spec.loras as the runtime is given it."""

    name: str
    source: str
    path: str  # the load's lora_path
    claim: str  # the claim it is read from; "" for hf://


@dataclass(slots=True, frozen=True)
class PodPlan:
    """What to do on one pod, and what stays as it is."""

    unload: tuple[str, ...]  # loaded, but not (or not from this source) in spec.loras
    load: tuple[Wanted, ...]
    kept: Mapping[str, str]  # name -> path: loaded as spec.loras wants
    waiting: Mapping[str, str]  # name -> why it is not loaded on this pod yet


def wanted_adapters(loras: Sequence[LoraSpec]) -> tuple[Wanted, ...]:
    """spec.loras as loads (sources already checked by parsing)."""
    return tuple(
        Wanted(
            name=lora.name,
            source=lora.source,
            path=lora_path(lora.source),
            claim=parse_model_uri(lora.source).pvc_claim,
        )
        for lora in loras
    )


def lora_pods(pods: Sequence[Mapping[str, Any]]) -> list[LoraPod]:
    """The pods to work on: ready, not being deleted, with an IP; sorted by name."""
    found = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(
            cond.get("type") == "Ready" and cond.get("status") == "True"
            for cond in status.get("conditions") or []
        )
        if not ready or meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        spec = pod.get("spec") or {}
        runtime = next(
            (c for c in spec.get("containers") or [] if c.get("name") == CONTAINER_NAME), {}
        )
        found.append(
            LoraPod(
                name=meta.get("name", ""),
                uid=meta.get("uid", ""),
                ip=status["podIP"],
                lora_enabled=ENABLE_FLAG in (runtime.get("args") or []),
                claims=_mounted_claims(spec, runtime),
            )
        )
    return sorted(found, key=lambda p: p.name)


def _mounted_claims(spec: Mapping[str, Any], container: Mapping[str, Any]) -> frozenset[str]:
    claims = {
        v["name"]: v["persistentVolumeClaim"].get("claimName", "")
        for v in spec.get("volumes") or []
        if v.get("persistentVolumeClaim") and v.get("name")
    }
    return frozenset(
        claims[m["name"]]
        for m in container.get("volumeMounts") or []
        if m.get("name") in claims
        and str(m.get("mountPath", "")).rstrip("/") == f"{MODELS_MOUNT_ROOT}/{claims[m['name']]}"
    )


def plan_pod(
    pod: LoraPod,
    wanted: Sequence[Wanted],
    listed: Mapping[str, str],
    ours: Mapping[str, str],
    held_back: Mapping[str, str],
) -> PodPlan:
    """The plan for one pod (lora_enabled: pods that are not are never planned for).

    `listed`: the pod's adapters, name -> root, as /v1/models gives them. `ours`: what the
    operator loaded on this pod, name -> path; it wins over `root` for an adapter still listed
    (the path is what the operator compares with spec.loras, whatever form the runtime reports
    it in). `held_back`: adapters this pod refused from the wanted path, whose retry is not due
    (name -> the refusal): neither loaded nor waiting; the caller reports them refused.
    """
    current = {name: ours.get(name, root) for name, root in listed.items()}
    by_name = {w.name: w for w in wanted}
    kept = {n: p for n, p in current.items() if n in by_name and by_name[n].path == p}
    unload = tuple(sorted(n for n in current if n not in kept))
    load: list[Wanted] = []
    waiting: dict[str, str] = {}
    for w in wanted:
        if w.name in kept or w.name in held_back:
            continue
        if w.claim and w.claim not in pod.claims:
            waiting[w.name] = (
                f"pod {pod.name} does not mount claim {w.claim} yet (its replacement will)"
            )
        else:
            load.append(w)
    return PodPlan(unload=unload, load=tuple(load), kept=kept, waiting=waiting)


def retry_delay(refusals: int) -> float:
    """Seconds before a load refused `refusals` times in a row is tried again."""
    return min(REFUSED_RETRY_SECONDS * 2 ** max(0, refusals - 1), REFUSED_RETRY_MAX_SECONDS)
