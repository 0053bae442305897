"""What wakes a loop of ObjectLoops early (the LoRA adapters' loop acts on news at once): a new
generation of its object, or a pod of it changing; not a status write, nor another object's
pod. And which objects get an adapters' loop at all."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvfleet.operator.lora_tasks import lists_loras
from kvfleet.operator.object_loops import ObjectLoops, WatchedObject


def isvc(generation: int = 1, name: str = "chat", **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": generation}
    return {"metadata": meta, "spec": {"loras": [{"name": "sql", "source": "hf://o/s"}]}, **extra}


async def test_a_new_generation_or_a_pod_wakes_the_loop_and_a_status_write_does_not():
    seen: dict[str, WatchedObject] = {}

    async def run(watched: WatchedObject) -> None:
        seen[watched.body["metadata"]["name"]] = watched
        await watched.stop.wait()

    loops = ObjectLoops(run, lists_loras, label="test", log=logging.getLogger("test"))
    loops.observe(None, isvc())
    loops.observe(None, isvc(name="other"))
    await asyncio.sleep(0.05)
    chat = seen["chat"]
    loops.observe("MODIFIED", isvc(status={"loras": []}))
    assert not chat.wake.is_set() and chat.body["status"] == {"loras": []}
    loops.observe("MODIFIED", isvc(generation=2))
    assert chat.wake.is_set()
    chat.wake.clear()
    loops.wake_up("ml", "other")
    assert not chat.wake.is_set() and seen["other"].wake.is_set()
    loops.wake_up("ml", "chat")
    assert chat.wake.is_set()
    await loops.stop_all()


def test_only_objects_listing_adapters_get_a_loop():
    assert lists_loras(isvc())
    assert not lists_loras({"spec": {"loras": []}})
    assert not lists_loras({"spec": {}})
    assert not lists_loras({"spec": {"loras": "sql"}})
