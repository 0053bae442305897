"""Pod IPs and the pods' port on one host: each simulated pod is a loopback address of its own
(127.0.0.2, 127.0.0.3, …), and every pod listens on the same port, as in a cluster."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvfleet import contract

FIRST_IP = 2  # 127.0.0.1 stays the API server's and the load's


def pod_ips(count: int) -> list[str]:
    """The loopback addresses the simulator hands out as pod IPs."""
    if not 1 <= count <= 250:
        raise ValueError(f"max_pods: must be in 1..250, got {count}")
    return [f"127.0.0.{FIRST_IP + i}" for i in range(count)]


def choose_port(hosts: Sequence[str], preferred: int = contract.RUNTIME_PORT) -> int:
    """`preferred` when it can be bound on every host, else a port free on all of them
    (`preferred` 0: any free port, away from 8000 where other runs on the host may be)."""

    def free_everywhere(port: int) -> bool:
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            return False
        return True

    if preferred and free_everywhere(preferred):
        return preferred
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        if free_everywhere(port):
            return port
    raise RuntimeError(f"no TCP port is free on all of {', '.join(hosts)}")
