"""The engine core's own process: load the model, then step while there is work and sleep on
the input socket while there is none.

Started by `CoreClient` (core_client.py) with multiprocessing's spawn method, so the model,
torch's threads and (under tensor parallelism) the process group all belong to this process:
the server's interpreter never waits on a forward pass, and the core never waits on a
tokenizer, an SSE write or a JSON parse. It reads `ToCore` messages on one ZeroMQ socket and
writes `FromCore` messages on another; it ignores SIGINT and SIGTERM (the server decides when
it stops, after draining) and dies with its parent.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.core_messages import (
    AbortRequests,
    AddLora,
    AddRequests,
    CoreDied,
    FromCore,
    LoadFailed,
    Ready,
    RemoveLora,
    Shutdown,
    StepOutputs,
    ToCore,
)

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore

log = logging.getLogger("kvfleet.core")

# How often an idle core checks the health of its tensor-parallel workers: a dead one ends the
# core, and with it the server, within about this.
HEALTH_POLL_MS = 1000


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux): a server killed with
    SIGKILL must not leave a core holding the GPU."""
    if sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_core_process(
    config: EngineConfig, input_address: str, output_address: str, log_level: int
) -> None:
    """The process's whole life: load, report Ready (or LoadFailed), serve steps, exit."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    context = zmq.Context(1)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)  # the last message (CoreDied) gets out before exit
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()

    def send(message: FromCore) -> None:
        outputs.send(encoder.encode(message), copy=False)

    try:
        from kvfleet.runtime.engine.core import EngineCore

        core = EngineCore(config)
        # Loaded means able to generate: a short warm-up generation proves it.
        core.warm_up()
    except BaseException as exc:
        log.error("could not load the model: %s", exc)
        send(LoadFailed(str(exc) or type(exc).__name__))
        _close(inputs, outputs, context)
        os._exit(1)
    send(Ready(core.info, core.stats()))
    try:
        CoreLoop(core, inputs, send).run()
    except BaseException as exc:
        log.error("engine core failed:\n%s", traceback.format_exc())
        send(CoreDied(f"engine failed: {type(exc).__name__}: {exc}"))
        core.close()
        _close(inputs, outputs, context)
        os._exit(1)
    core.close()
    _close(inputs, outputs, context)
    # Stopped and closed: skip the interpreter's teardown of torch and the model (a third of a
    # second on 2 cores, which the server's stop, and a pod's termination, would wait for).
    logging.shutdown()
    os._exit(0)


def add_lora(core: EngineCore, message: AddLora) -> str:
    """Load the adapter; "" when loaded, else why not (LoraError's message, or the error of a
    load that failed otherwise: the adapter is refused, the core goes on)."""
    from kvfleet.runtime.models.lora import LoraError

    try:
        core.add_lora(message.lora_id, message.name, message.path)
    except LoraError as exc:
        return str(exc)
    except Exception as exc:
        log.exception("loading LoRA adapter %r failed", message.name)
        return f"adapter {message.name!r}: loading failed: {type(exc).__name__}: {exc}"
    return ""


def _close(*closable: zmq.Socket | zmq.Context) -> None:
    for c in closable:
        c.close() if isinstance(c, zmq.Socket) else c.term()


class CoreLoop:
    """Steps the core while it has work; between steps takes in every message waiting."""

    def __init__(
        self, core: EngineCore, inputs: zmq.Socket, send: Callable[[FromCore], None]
    ) -> None:
        self.core = core
        self.inputs = inputs
        self.send = send
        self.decoder = msgspec.msgpack.Decoder(ToCore)

    def run(self) -> None:
        core = self.core
        poller = zmq.Poller()
        poller.register(self.inputs, zmq.POLLIN)
        while True:
            # Idle: sleep on the socket (waking to check the workers' health); busy: only take
            # in what is already there.
            timeout = 0 if core.has_unfinished() else HEALTH_POLL_MS
            received = False
            refused: list[tuple[str, str]] = []
            loras: list[tuple[int, str]] = []
            while poller.poll(timeout):
                timeout, received = 0, True
                message = self.decoder.decode(self.inputs.recv(copy=False))
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AddRequests):
                    try:
                        core.add(message.requests)
                    except Exception as exc:  # the server validated it: a defect, not input
                        log.exception("refused a request the server had accepted")
                        refused.extend((r.request_id, str(exc)) for r in message.requests)
                elif isinstance(message, AbortRequests):
                    core.abort(message.request_ids, message.reason)
                elif isinstance(message, AddLora):
                    loras.append((message.lora_id, add_lora(core, message)))
                elif isinstance(message, RemoveLora):
                    core.remove_lora(message.lora_id)
            if core.has_unfinished():
                outputs = core.step()
                self.send(StepOutputs(outputs, core.stats(), time.monotonic(), refused, loras))
            else:
                core.check_health()
                if received:  # aborts, refusals or adapters changed something: say so
                    self.send(StepOutputs([], core.stats(), time.monotonic(), refused, loras))
