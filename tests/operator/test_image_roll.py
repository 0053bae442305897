"""A changed default runtime image reaches the services using it a few at a time
(operator/image_roll.py): the pure decision, and the state that feeds it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kube_harness import isvc_with
from kvfleet.operator.handlers import OperatorConfig
from kvfleet.operator.image_roll import (
    DEFAULT_IMAGE_ANNOTATION,
    DefaultImageRolls,
    RolloutView,
    image_to_render,
    rolled_out,
    view_of,
)
from kvfleet.operator.render import render_deployment
from kvfleet.operator.spec import parse_spec

OLD, NEW = "registry.example/runtime:1", "registry.example/runtime:2"


def rolling(image: str = NEW, rendered_default: str | None = NEW) -> RolloutView:
    return RolloutView(image, rendered_default, rolled_out=False)


def done(image: str = NEW) -> RolloutView:
    return RolloutView(image, image, rolled_out=True)


def test_a_service_on_the_old_image_waits_while_the_limit_is_rolling():
    on_old = RolloutView(OLD, OLD, True)
    others = {("ns", "a"): rolling(), ("ns", "b"): done(), ("ns", "c"): on_old}
    assert image_to_render(("ns", "x"), NEW, on_old, others, max_at_once=1) == OLD
    assert image_to_render(("ns", "x"), NEW, on_old, others, max_at_once=2) == NEW
    # Nothing rolling: its turn.
    others[("ns", "a")] = done()
    assert image_to_render(("ns", "x"), NEW, on_old, others, max_at_once=1) == NEW


def test_new_services_and_those_on_the_default_take_it_at_once():
    others = {("ns", "a"): rolling()}
    assert image_to_render(("ns", "x"), NEW, None, others, max_at_once=1) == NEW
    assert image_to_render(("ns", "x"), NEW, rolling(), others, max_at_once=1) == NEW


def test_pinned_services_and_the_service_itself_are_not_counted():
    on_old = RolloutView(OLD, OLD, True)
    # A service pinning the new image by name is not part of the roll.
    others = {("ns", "pinned"): rolling(rendered_default=None), ("ns", "x"): rolling()}
    assert image_to_render(("ns", "x"), NEW, on_old, others, max_at_once=1) == NEW
    # Nor is one from an operator that did not yet mark what it rendered with.
    assert image_to_render(("ns", "y"), NEW, RolloutView(OLD, None, True), {}, 1) == NEW


def test_an_image_edited_by_hand_is_put_back_at_once():
    edited = RolloutView("evil:latest", NEW, rolled_out=True)
    others = {("ns", "a"): rolling()}
    assert image_to_render(("ns", "x"), NEW, edited, others, max_at_once=1) == NEW


def deployment(image: str, *, ready: int, replicas: int = 2, generation: int = 2) -> dict:
    isvc = isvc_with("chat")
    isvc["metadata"].update(uid="u1", generation=1)
    dep = render_deployment(isvc, image)
    dep["metadata"]["generation"] = generation
    dep["spec"]["replicas"] = replicas
    dep["status"] = {
        "observedGeneration": generation,
        "updatedReplicas": ready,
        "availableReplicas": ready,
    }
    return dep


def test_a_deployment_has_rolled_out_when_every_replica_is_updated_and_available():
    assert rolled_out(deployment(NEW, ready=2))
    assert not rolled_out(deployment(NEW, ready=1))
    stale = deployment(NEW, ready=2)
    stale["status"]["observedGeneration"] = 1  # the controller has not seen the new template
    assert not rolled_out(stale)
    view = view_of(deployment(NEW, ready=2))
    assert view == RolloutView(NEW, NEW, True)


def test_only_a_spec_without_an_image_is_marked_with_the_default_it_got():
    isvc = isvc_with("chat")
    isvc["metadata"].update(uid="u1", generation=1)
    annotations = render_deployment(isvc, NEW)["metadata"]["annotations"]
    assert annotations[DEFAULT_IMAGE_ANNOTATION] == NEW
    pinned = copy.deepcopy(isvc)
    pinned["spec"]["runtime"] = {"image": "mine:1"}
    dep = render_deployment(pinned, NEW)
    assert DEFAULT_IMAGE_ANNOTATION not in dep["metadata"]["annotations"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:1"


def test_a_service_without_gpus_gets_the_cpu_image():
    config = OperatorConfig(default_runtime_image="gpu:1", default_runtime_cpu_image="cpu:1")
    with_gpu = parse_spec({**isvc_with("chat")["spec"], "resources": {"gpus": 1}})
    without = parse_spec({**isvc_with("chat")["spec"], "resources": {"gpus": 0}})
    assert config.default_image(with_gpu) == "gpu:1"
    assert config.default_image(without) == "cpu:1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_decisions_count_each_other_and_a_finished_roll_wakes_the_held():
    clock = Clock()
    rolls = DefaultImageRolls(max_at_once=1, settle_seconds=5, clock=clock)
    woken: list[tuple[Any, ...]] = []
    rolls.requeue = lambda *args: woken.append(args)
    old = deployment(OLD, ready=2)
    for key in (("ns", "a"), ("ns", "b")):
        rolls.observe(key, old)
    # Right after start the watch may not have shown every Deployment yet: no roll starts.
    assert rolls.decide(("ns", "a"), NEW, lambda: old) == OLD
    assert 5 < rolls.retry_in() < 5.2
    clock.now += 6
    assert rolls.decide(("ns", "a"), NEW, lambda: old) == NEW
    # The first decision counts before any watch event shows its Deployment changed.
    assert rolls.decide(("ns", "b"), NEW, lambda: old) == OLD
    assert rolls.held() == {("ns", "b")}
    rolls.observe(("ns", "a"), deployment(NEW, ready=1, generation=3))
    assert woken == []
    rolls.observe(("ns", "a"), deployment(NEW, ready=2, generation=3))
    assert woken == [("ns", "b")]
    assert rolls.decide(("ns", "b"), NEW, lambda: old) == NEW
    assert rolls.held() == set()


def test_the_limit_must_be_at_least_one():
    with pytest.raises(ValueError, match="max_at_once: must be >= 1, got 0"):
        DefaultImageRolls(max_at_once=0)
