"""What the adapters' pass found, in the shapes it is reported in: `status.loras`, the Degraded
condition of a refused adapter, and the Events `kubectl describe` lists. Pure.

status.loras is written by the adapters' loop (lora_sync.py); the Degraded condition by the
reconciler alone (status.py calls `lora_problem` on the status.loras it reads), so that one
writer owns each condition, and only for adapters spec.loras still lists from that source.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator import conditions as c
from kvfleet.operator.isvc_events import isvc_event
from kvfleet.operator.lora_spec import LoraSpec

LOADED, LOADING, REJECTED, PENDING = "Loaded", "Loading", "Rejected", "Pending"
ADAPTER_REJECTED = "LoraAdapterRejected"  # the Degraded reason and the Warning Event's
ADAPTERS_LOADED, ADAPTERS_UNLOADED = "LoraAdaptersLoaded", "LoraAdaptersUnloaded"
MAX_SHOWN = 3  # pods named in one message


@dataclass(slots=True, frozen=True)
class PodOutcome:
    """One pod after a pass: its adapters (name -> path), those it refused (name -> the
    runtime's message), those it does not have for another reason (name -> why), what this
    pass changed, or `error` when the pod could not be worked on at all."""

    pod: str
    loaded: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    waiting: Mapping[str, str] = field(default_factory=dict)
    error: str = ""
    newly_loaded: tuple[str, ...] = ()
    unloaded: tuple[str, ...] = ()


def loras_status(
    loras: Sequence[LoraSpec], paths: Mapping[str, str], outcomes: Sequence[PodOutcome]
) -> list[dict[str, Any]]:
    """`status.loras`: per adapter of spec.loras, in its order, where it is loaded and its
    state. `paths`: name -> the path it is loaded from (what a pod's `loaded` must hold)."""
    entries = []
    for lora in loras:
        path = paths[lora.name]
        pods = [o.pod for o in outcomes if o.loaded.get(lora.name) == path]
        refusals = [(o.pod, o.refused[lora.name]) for o in outcomes if lora.name in o.refused]
        entry: dict[str, Any] = {
            "name": lora.name,
            "source": lora.source,
            "loadedReplicas": len(pods),
            "pods": pods,
        }
        if refusals:
            entry["state"] = REJECTED
            entry["message"] = _joined(f"pod {pod}: {message}" for pod, message in refusals)
        elif not outcomes:
            entry["state"] = PENDING
            entry["message"] = "no ready replica to load it into yet"
        elif len(pods) == len(outcomes):
            entry["state"] = LOADED
            entry["message"] = ""
        else:
            entry["state"] = LOADING
            why = (
                o.error or o.waiting.get(lora.name) or f"pod {o.pod}: loading"
                for o in outcomes
                if o.pod not in pods
            )
            entry["message"] = (
                f"loaded on {len(pods)} of {len(outcomes)} ready replicas; {_joined(why)}"
            )
        entries.append(entry)
    return entries


def _joined(parts: Iterable[str]) -> str:
    items = list(parts)
    more = len(items) - MAX_SHOWN
    return "; ".join(items[:MAX_SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def lora_problem(
    loras: Sequence[LoraSpec], reported: Sequence[Mapping[str, Any]] | None
) -> c.Condition | None:
    """Degraded for the adapters a runtime refused, among those spec.loras still lists from
    the same source (status.loras may predate the latest spec); None when there are none."""
    wanted = {(lora.name, lora.source) for lora in loras}
    rejected = [
        e
        for e in reported or ()
        if e.get("state") == REJECTED and (e.get("name"), e.get("source")) in wanted
    ]
    if not rejected:
        return None
    message = "; ".join(
        f"adapter {e['name']} ({e['source']}) was refused: {e.get('message', '')}" for e in rejected
    )
    return c.Condition(c.DEGRADED, c.TRUE, ADAPTER_REJECTED, message)


def pass_events(
    outcomes: Sequence[PodOutcome], sources: Mapping[str, str], announced: set[tuple[str, str]]
) -> tuple[list[tuple[str, str, str]], set[tuple[str, str]]]:
    """The Events of one pass, (type, reason, message), and the refusals announced so far.

    A refusal is announced once per adapter, source and message (a retry refused the same way
    posts nothing); it may be announced again once the adapter loaded or left spec.loras.
    Loads and unloads get one Normal Event each per pass, naming every pod."""
    events: list[tuple[str, str, str]] = []
    still = {
        (name, f"{sources[name]}\x00{message}")
        for o in outcomes
        for name, message in o.refused.items()
        if name in sources
    }
    for o in outcomes:
        for name, message in sorted(o.refused.items()):
            key = (name, f"{sources.get(name, '')}\x00{message}")
            if name in sources and key not in announced:
                announced = announced | {key}
                events.append(
                    (
                        "Warning",
                        ADAPTER_REJECTED,
                        f"adapter {name} ({sources[name]}) refused by pod {o.pod}: {message}",
                    )
                )
    for reason, attr, verb in (
        (ADAPTERS_LOADED, "newly_loaded", "loaded"),
        (ADAPTERS_UNLOADED, "unloaded", "unloaded"),
    ):
        done = [
            f"{', '.join(getattr(o, attr))} on pod {o.pod}" for o in outcomes if getattr(o, attr)
        ]
        if done:
            events.append(("Normal", reason, f"{verb} {'; '.join(done)}"))
    return events, announced & still


def lora_event(
    isvc: Mapping[str, Any], type_: str, reason: str, message: str, now: str
) -> dict[str, Any]:
    """An Event of the adapters' loop about the InferenceService."""
    return isvc_event(isvc, type_, reason, message, now, "operator")
