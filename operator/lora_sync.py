"""One pass of the LoRA adapters' loop over one InferenceService: its I/O around the pure plan.

The InferenceService's pods (lora_plan.lora_pods) → the API key from spec.apiKeySecretRef's
Secret, read now (every /v1 path of the runtime wants it) → per pod, concurrently: GET
/v1/models, `plan_pod`, the unloads and then the loads, one adapter at a time (a load may
download; one pod is not asked to do two at once) → `status.loras`, preconditioned on the
resourceVersion read, and the pass's Events. lora_tasks.py runs passes and, when status.loras
changed, has the reconciler derive the Degraded condition from it.

`LoraState` is what the loop remembers between passes (a restart forgets it, and then goes by
what the pods list): what the operator loaded on each pod, and the loads a pod refused, tried
again after a backoff (lora_plan.retry_delay) or at once after a spec change.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kvfleet.operator import conditions as c
from kvfleet.operator.kube_api import EVENTS, ISVCS, PODS, SECRETS, KubeApi, KubeApiError
from kvfleet.operator.lora_client import (
    Answer,
    LoraApiError,
    list_adapters,
    load_adapter,
    pod_url,
    unload_adapter,
)
from kvfleet.operator.lora_plan import (
    LoraPod,
    Wanted,
    lora_pods,
    plan_pod,
    retry_delay,
    wanted_adapters,
)
from kvfleet.operator.lora_status import PodOutcome, lora_event, loras_status, pass_events
from kvfleet.operator.render import selector_string
from kvfleet.operator.spec import SecretKeyRef, SpecError, parse_spec

log = logging.getLogger("kvfleet.lora")


@dataclass(slots=True)
class Refusal:
    """A load a pod refused (its runtime's 400), and when to try it again."""

    message: str
    count: int  # refusals in a row
    retry_at: float  # time.monotonic()


@dataclass(slots=True)
class LoraState:
    """What the loop of one InferenceService remembers between passes."""

    generation: int = -1
    ours: dict[str, dict[str, str]] = field(default_factory=dict)  # pod uid -> name -> path
    refusals: dict[tuple[str, str, str], Refusal] = field(default_factory=dict)  # uid, name, path
    announced: set[tuple[str, str]] = field(default_factory=set)  # refusals posted as Events


class ApiKeyUnavailable(RuntimeError):
    """spec.apiKeySecretRef names a Secret or key that is not there."""


def read_api_key(api: KubeApi, namespace: str, ref: SecretKeyRef | None) -> str | None:
    """The pods' API key from its Secret (None: the pods have none). Read at every pass, never
    kept: a rotated key is picked up by the next pass (and by the pods once restarted)."""
    if ref is None:
        return None
    secret = api.get(SECRETS, namespace, ref.name)
    if secret is None:
        raise ApiKeyUnavailable(f"spec.apiKeySecretRef: Secret {ref.name} not found")
    value = (secret.get("data") or {}).get(ref.key)
    if value is None:
        raise ApiKeyUnavailable(f"spec.apiKeySecretRef: Secret {ref.name} has no key {ref.key}")
    try:
        return base64.b64decode(value).decode().strip()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ApiKeyUnavailable(
            f"spec.apiKeySecretRef: key {ref.key} of Secret {ref.name} is not text: {exc}"
        ) from None


async def sync_once(
    api: KubeApi,
    isvc: Mapping[str, Any],
    state: LoraState,
    session: aiohttp.ClientSession,
    port: int,
) -> bool:
    """One pass; True when it changed status.loras. A spec that does not parse is left to the
    reconciler, which reports it."""
    meta = isvc["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        spec = parse_spec(isvc.get("spec") or {})
    except SpecError:
        return False
    if not spec.lora_enabled:
        return False
    generation = int(meta.get("generation") or 0)
    if generation != state.generation:  # a spec change: what was refused is tried again now
        state.generation, state.refusals = generation, {}
    wanted = wanted_adapters(spec.loras)
    pods = lora_pods(await asyncio.to_thread(api.list, PODS, namespace, selector_string(name)))
    key, key_error = None, ""
    if any(p.lora_enabled for p in pods):
        try:
            key = await asyncio.to_thread(read_api_key, api, namespace, spec.api_key_secret_ref)
        except ApiKeyUnavailable as exc:
            key_error = str(exc)
    now = time.monotonic()
    outcomes = list(
        await asyncio.gather(
            *(_sync_pod(p, wanted, key, key_error, state, session, port, now) for p in pods)
        )
    )
    _forget_gone_pods(state, {p.uid for p in pods})

    status = loras_status(spec.loras, {w.name: w.path for w in wanted}, outcomes)
    events, state.announced = pass_events(
        outcomes, {w.name: w.source for w in wanted}, state.announced
    )
    stamp = c.now_rfc3339()
    for type_, reason, message in events:
        log.info("%s/%s: %s: %s", namespace, name, reason, message)
        try:
            await asyncio.to_thread(
                api.create, EVENTS, namespace, lora_event(isvc, type_, reason, message, stamp)
            )
        except KubeApiError as exc:  # the adapters are as they are; a lost Event changes nothing
            log.warning("%s/%s: could not post the %s Event: %s", namespace, name, reason, exc)
    return await asyncio.to_thread(write_loras_status, api, namespace, name, status)


async def _sync_pod(
    pod: LoraPod,
    wanted: Sequence[Wanted],
    key: str | None,
    key_error: str,
    state: LoraState,
    session: aiohttp.ClientSession,
    port: int,
    now: float,
) -> PodOutcome:
    if not pod.lora_enabled:
        return PodOutcome(
            pod.name, error=f"pod {pod.name} runs without --enable-lora (the rollout replaces it)"
        )
    if key_error:
        return PodOutcome(pod.name, error=f"pod {pod.name}: {key_error}")
    base = pod_url(pod.ip, port)
    try:
        listed = await list_adapters(session, base, key)
    except LoraApiError as exc:
        return PodOutcome(pod.name, error=f"pod {pod.name}: {exc}")
    ours = state.ours.setdefault(pod.uid, {})
    for name in [n for n in ours if n not in listed]:  # a restarted runtime has none
        del ours[name]
    held = {}
    for w in wanted:
        refusal = state.refusals.get((pod.uid, w.name, w.path))
        if refusal is not None and refusal.retry_at > now:
            held[w.name] = refusal.message
    plan = plan_pod(pod, wanted, listed, ours, held)

    loaded, waiting, refused = dict(plan.kept), dict(plan.waiting), dict(held)
    unloaded, newly, stuck = [], [], set()
    for name in plan.unload:
        answer = await unload_adapter(session, base, key, name)
        if answer.ok:
            ours.pop(name, None)
            unloaded.append(name)
        else:
            stuck.add(name)
            waiting[name] = f"pod {pod.name}: unloading its former {name} failed: {answer.message}"
    for w in plan.load:
        if w.name in stuck:  # the former adapter of that name is still there
            continue
        answer = await load_adapter(session, base, key, w.name, w.path)
        refusal_key = (pod.uid, w.name, w.path)
        if answer.refused and await _loaded_meanwhile(session, base, key, w):
            answer = Answer(True)
        if answer.ok:
            loaded[w.name] = ours[w.name] = w.path
            newly.append(w.name)
            state.refusals.pop(refusal_key, None)
        elif answer.refused:
            count = state.refusals[refusal_key].count + 1 if refusal_key in state.refusals else 1
            state.refusals[refusal_key] = Refusal(answer.message, count, now + retry_delay(count))
            refused[w.name] = answer.message
        else:
            waiting[w.name] = f"pod {pod.name}: {answer.message}"
    return PodOutcome(
        pod.name,
        loaded=loaded,
        refused=refused,
        waiting=waiting,
        newly_loaded=tuple(newly),
        unloaded=tuple(unloaded),
    )


async def _loaded_meanwhile(
    session: aiohttp.ClientSession, base: str, key: str | None, w: Wanted
) -> bool:
    """Whether the pod has `w` loaded from its path after all: a load the previous pass gave
    up waiting for (a long download) may have finished since, and this one was then refused
    as a name already loaded."""
    try:
        return (await list_adapters(session, base, key)).get(w.name) == w.path
    except LoraApiError:
        return False


def _forget_gone_pods(state: LoraState, uids: set[str]) -> None:
    for uid in [u for u in state.ours if u not in uids]:
        del state.ours[uid]
    for k in [k for k in state.refusals if k[0] not in uids]:
        del state.refusals[k]


def write_loras_status(
    api: KubeApi, namespace: str, name: str, loras: list[dict[str, Any]]
) -> bool:
    """Merge `status.loras` into the object's status, preconditioned on its resourceVersion;
    True when written. Nothing is written once the object no longer lists adapters (the
    reconciler then removes status.loras) or is being deleted."""

    def compute(isvc: dict[str, Any]) -> dict[str, Any] | None:
        if isvc["metadata"].get("deletionTimestamp") or not (isvc.get("spec") or {}).get("loras"):
            return None
        if (isvc.get("status") or {}).get("loras") == loras:
            return None
        return {"status": {"loras": loras}}

    outcome = api.patch_preconditioned(ISVCS, namespace, name, compute, sub="status")
    if outcome == "conflict":
        log.info(
            "%s/%s: status kept changing under the write; the next pass writes it", namespace, name
        )
    return outcome == "written"
