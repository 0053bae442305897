"""A new default runtime image (the operator's --default-runtime-image or
--default-runtime-cpu-image, changed by an upgrade) reaches the InferenceServices that use it a
few at a time: at most `max_at_once` of them have pods on the new image that are not all ready,
and the next starts when one of those has rolled out. A service that names spec.runtime.image is
never touched; a new service starts on the new image at once (it has nothing to roll from).

Why: every such service restarting at once needs a spare GPU each (maxSurge) and, should the
new image be bad, takes every service down together. The decision is a pure function
(`image_to_render`); `DefaultImageRolls` keeps what it needs, the Deployments as their watch
events last showed them, and takes each decision under a lock, so that two reconciles running
at once cannot both take the last slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# On Deployments whose runtime image is the operator's default (not spec.runtime.image): the
# default image they were rendered with. One rendered with today's default but running another
# image was edited by hand, and is put back at once rather than queued as a roll.
DEFAULT_IMAGE_ANNOTATION = "kvfleet.dev/default-runtime-image"
DEFAULT_MAX_ROLLS = 1
# Deployments are learnt from their watch, which starts with the operator: before it has
# listed them all, rolls in flight would go uncounted. No roll starts this soon after start.
SETTLE_SECONDS = 5.0
# Held services are reconciled again when a roll ends; this is the fallback should that news
# be missed (a watch that restarted).
RECHECK_SECONDS = 30.0

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True, slots=True)
class RolloutView:
    """What the roll needs of one Deployment."""

    image: str | None  # the runtime container's image
    rendered_default: str | None  # the default image it was rendered with (None: pinned/older)
    rolled_out: bool  # every replica runs the current template and is available


def runtime_image(deployment: Mapping[str, Any]) -> str | None:
    """The image of the pod template's runtime container (its first container)."""
    containers = (((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
        "containers"
    ) or [{}]
    return containers[0].get("image")


def rolled_out(deployment: Mapping[str, Any]) -> bool:
    """As `kubectl rollout status` says done: the controller saw the current generation and
    every wanted replica is updated and available."""
    meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
    status = deployment.get("status") or {}
    want = int(spec.get("replicas", 1))
    return (
        int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and int(status.get("updatedReplicas") or 0) >= want
        and int(status.get("availableReplicas") or 0) >= want
    )


def view_of(deployment: Mapping[str, Any]) -> RolloutView:
    annotations = (deployment.get("metadata") or {}).get("annotations") or {}
    return RolloutView(
        runtime_image(deployment),
        annotations.get(DEFAULT_IMAGE_ANNOTATION),
        rolled_out(deployment),
    )


def rolls_from(current: RolloutView | None, default_image: str) -> str | None:
    """The image a move to `default_image` rolls this Deployment from; None when it is no roll
    to a new default (a new service, one already there, a hand edit of one rendered with it)."""
    if current is None or current.image == default_image:
        return None
    return current.image if current.rendered_default != default_image else None


def image_to_render(
    key: Key,
    default_image: str,
    current: RolloutView | None,
    others: Mapping[Key, RolloutView],
    max_at_once: int,
) -> str:
    """The image for `key`'s Deployment, whose spec names none: the default, unless it runs an
    older default and `max_at_once` others are still rolling out to the default (then the one
    it runs). `current` is its Deployment (None: not created yet)."""
    old = rolls_from(current, default_image)
    if old is None:
        return default_image
    in_flight = sum(
        1
        for other, view in others.items()
        if other != key and view.rendered_default == default_image
        and view.image == default_image and not view.rolled_out
    )  # fmt: skip
    return default_image if in_flight < max_at_once else old


class DefaultImageRolls:
    """The Deployments' roll state and the decisions taken on it (one per operator)."""

    def __init__(
        self,
        max_at_once: int = DEFAULT_MAX_ROLLS,
        settle_seconds: float = SETTLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_at_once < 1:
            raise ValueError(f"max_at_once: must be >= 1, got {max_at_once}")
        self.max_at_once = max_at_once
        self._clock = clock
        self._settled_at = clock() + settle_seconds
        self._views: dict[Key, RolloutView] = {}
        self._held: set[Key] = set()
        self._lock = threading.Lock()
        # Reconciles a held service (namespace, name, delay): the operator's refresh queue.
        self.requeue: Callable[..., None] = lambda namespace, name, delay=0.0: None

    def observe(self, key: Key, deployment: Mapping[str, Any] | None) -> None:
        """A Deployment's watch event (None: deleted). A roll that ends frees a slot: every
        held service is reconciled again."""
        with self._lock:
            before = self._views.get(key)
            if deployment is None:
                self._views.pop(key, None)
                self._held.discard(key)
            else:
                self._views[key] = view_of(deployment)
            after = self._views.get(key)
            freed = (
                before is not None and not before.rolled_out and (after is None or after.rolled_out)
            )
            wake = sorted(self._held) if freed else []
        for namespace, name in wake:
            self.requeue(namespace, name)

    def decide(
        self, key: Key, default_image: str, read: Callable[[], Mapping[str, Any] | None]
    ) -> str:
        """image_to_render for `key`, recorded at once: the next decision counts this one's
        roll. `read` gets its Deployment, asked only when the watch has not shown it on the
        default image already (the common case costs no request)."""
        with self._lock:
            known = self._views.get(key)
        if known is not None and known.image == default_image:
            return default_image
        deployment = read()
        current = view_of(deployment) if deployment is not None else None
        with self._lock:
            old = rolls_from(current, default_image)
            if old is not None and self._clock() < self._settled_at:
                image = old
            else:
                image = image_to_render(key, default_image, current, self._views, self.max_at_once)
            if current is not None and image != current.image:  # a roll starts
                self._views[key] = RolloutView(image, image, False)
            if image != default_image:
                self._held.add(key)
            else:
                self._held.discard(key)
        return image

    def held(self) -> set[Key]:
        """Services waiting for their turn."""
        with self._lock:
            return set(self._held)

    def retry_in(self) -> float:
        """Seconds until a held service should be reconciled again without news of a roll."""
        settling = self._settled_at - self._clock()
        return settling + 0.1 if settling > 0 else RECHECK_SECONDS
