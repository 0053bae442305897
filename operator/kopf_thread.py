"""kopf in its own thread and event loop, for running the operator inside another program
(`kvfleet demo autoscale`, the test suite).

At exit kopf waits for every task started in its event loop after it; run in the caller's
loop that would include the caller's own teardown, so it gets a thread of its own, as
`kopf.testing.KopfRunner` does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import kopf


@dataclass(slots=True)
class KopfThread:
    """A running operator: set `stop` to end it; `ready` is set once it watches."""

    stop: threading.Event
    ready: threading.Event
    thread: threading.Thread


def start_kopf_thread(registry: kopf.OperatorRegistry) -> KopfThread:
    """Start kopf, cluster-wide and standalone, with fast watch reconnects (local API servers
    restart their watches often) and no CRD scanning (the resources are known)."""
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.watching.reconnect_backoff = 0.1
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=kopf.run,
        kwargs=dict(
            registry=registry,
            settings=settings,
            clusterwide=True,
            standalone=True,
            stop_flag=stop,
            ready_flag=ready,
            memo=kopf.Memo(),
        ),
        name="kopf",
        daemon=True,
    )
    thread.start()
    return KopfThread(stop, ready, thread)
