"""`kvfleet demo autoscale` itself: the dev cluster's API server (kmock) on 127.0.0.1, the
operator (kopf, with the autoscaler) in a thread, the kubelet simulator running each replica as
a real `kvfleet serve` process (a random tiny model, one CPU thread) on its own 127.0.0.x
address, and a request load in three phases — light, heavy, light. One line per autoscaler
poll; at the end the timeline is plotted (timeline_plot.py) and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.test_utils
import kmock
import yaml
from kvfleet.devcluster.apiserver.emulator import RealisticEmulator
from kvfleet.devcluster.demo.endpoint_load import EndpointLoad
from kvfleet.devcluster.demo.timeline_plot import plot_timeline
from kvfleet.devcluster.kubelet.simulator import KubeletSim
from kvfleet.operator.autoscale_loop import OBSERVERS_SETTING, RUNTIME_PORT_SETTING, PollReport
from kvfleet.operator.handlers import OperatorConfig, build_registry
from kvfleet.operator.kopf_thread import start_kopf_thread
from kvfleet.operator.kube_api import KubeApi

NAMESPACE = "default"
NAME = "demo"
POLL_SECONDS = 1
DOWN_WINDOW_SECONDS = 10
TARGET_QUEUE = 2
MAX_REPLICAS = 3
MAX_TOKENS = 200
HEAVY_CONCURRENCY = 12


async def autoscale(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every request succeeded and no pod crashed."""
    polls: list[PollReport] = []
    t0 = time.time()
    phases: list[tuple[str, float, float]] = []
    sim_ref: list[KubeletSim] = []

    serving = threading.Event()  # quiet until the first pod serves

    def on_poll(report: PollReport) -> None:
        polls.append(report)
        if not serving.is_set():
            return
        sim = sim_ref[0] if sim_ref else None
        ready = len(sim.endpoints(NAME)) if sim else 0
        kv = "  –" if report.mean_kv_usage is None else f"{report.mean_kv_usage * 100:3.0f}%"
        change = f"{report.current} → {report.desired}" if report.scaled else f"{report.current}"
        line = (
            f"t={report.at - t0:6.1f}s  waiting {report.total_waiting:4.0f}  running "
            f"{report.total_running:3.0f}  KV {kv}  replicas {change:<6} ready {ready}"
        )
        if report.scaled:
            line += f"  {report.reason}"
        print(line, flush=True)

    emulator = RealisticEmulator()
    emulator.declare_core()
    server_cls = functools.partial(aiohttp.test_utils.RawTestServer, keepalive_timeout=0.2)
    with tempfile.TemporaryDirectory(prefix="kvfleet-demo-") as tmp:
        async with emulator, kmock.Server(emulator, server_cls=server_cls) as server:
            kubeconfig = Path(tmp) / "kubeconfig"
            url = str(server.url).rstrip("/")
            kubeconfig.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "demo", "cluster": {"server": url}}],
                        "users": [{"name": "demo", "user": {"token": "demo"}}],
                        "contexts": [
                            {"name": "demo", "context": {"cluster": "demo", "user": "demo"}}
                        ],
                        "current-context": "demo",
                    }
                )
            )
            os.environ["KUBECONFIG"] = str(kubeconfig)
            os.environ.pop("KUBERNETES_SERVICE_HOST", None)
            api = KubeApi.from_environment()
            sim = KubeletSim(api, NAMESPACE, Path(tmp) / "pods", max_pods=MAX_REPLICAS + 1)
            sim_ref.append(sim)
            config = OperatorConfig(api=KubeApi.from_environment())
            config.extra[RUNTIME_PORT_SETTING] = sim.port
            config.extra[OBSERVERS_SETTING] = [on_poll]
            running = start_kopf_thread(build_registry(config))
            results: list[Any] = []
            try:
                async with sim, aiohttp.ClientSession() as session:
                    await asyncio.to_thread(running.ready.wait, 30)
                    emulator.create_object(_ISVC, _inference_service())
                    print(
                        f"InferenceService {NAMESPACE}/{NAME}: autoscaling 1..{MAX_REPLICAS}"
                        f" on queue > {TARGET_QUEUE} per replica or KV > 80%, poll "
                        f"{POLL_SECONDS}s, scale-down window {DOWN_WINDOW_SECONDS}s; "
                        "waiting for the first pod…",
                        flush=True,
                    )
                    deadline = time.monotonic() + 180
                    while not sim.endpoints(NAME):
                        crash = next((e for e in sim.events if e.what == "crashed"), None)
                        if crash is not None or time.monotonic() > deadline:
                            why = f"crashed ({crash.detail})" if crash else "timed out (180 s)"
                            print(f"the first pod {why}", file=sys.stderr)
                            for pod in sim.pods.values():
                                tail = pod.log_path.read_text(errors="replace")[-2000:]
                                print(f"--- {pod.log_path.name}\n{tail}", file=sys.stderr)
                            return 1
                        await asyncio.sleep(0.2)
                    serving.set()
                    load = EndpointLoad(
                        lambda: sim.endpoints(NAME), model=NAME, max_tokens=MAX_TOKENS
                    )
                    plan = (
                        ("light", 0.15, 1),
                        ("heavy", 0.4, HEAVY_CONCURRENCY),
                        ("light", 0.45, 2),
                    )
                    heavy: asyncio.Task[list[Any]] | None = None
                    for phase, share, concurrency in plan:
                        start = time.time()
                        print(
                            f"--- {phase} load: {concurrency} concurrent requests for "
                            f"{share * args.duration:.0f}s",
                            flush=True,
                        )
                        halt = asyncio.Event()
                        task = asyncio.create_task(load.steady(session, concurrency, halt))
                        await asyncio.sleep(share * args.duration)
                        halt.set()
                        if phase == "heavy":  # its requests may end during the next phase
                            heavy = task
                        else:
                            results += await task
                        phases.append((phase, start - t0, time.time() - t0))
                    if heavy is not None:
                        results += await heavy
                    sim.raise_on_task_error()
            finally:
                running.stop.set()
                emulator.close_watches()
                config.api.api_client.rest_client.pool_manager.clear()
                await asyncio.to_thread(running.thread.join, 15)
            events = [
                {"t": e.at - t0, "pod": e.pod, "ip": e.ip, "event": e.what, "detail": e.detail}
                for e in sim.events
            ]

    failed = [r for r in results if not r.ok]
    crashed = [e for e in events if e["event"] in ("crashed", "killed")]
    timeline = _timeline(polls, phases, events, len(results), len(failed), t0)
    if args.json:
        args.json.write_text(json.dumps(timeline, indent=1) + "\n")
    plot_timeline(timeline, args.out)
    ups = sum(1 for p in polls if p.scaled and p.desired > p.current)
    downs = sum(1 for p in polls if p.scaled and p.desired < p.current)
    print(
        f"{len(results)} requests, {len(failed)} failed; {ups} scale-ups, {downs} scale-downs; "
        f"peak {max((p.desired for p in polls), default=0)} replicas; plot: {args.out}"
    )
    for e in crashed:
        print(f"pod {e['pod']} {e['event']}: {e['detail']}", file=sys.stderr)
    if failed:
        print(f"first failure: {failed[0]}", file=sys.stderr)
    return 1 if failed or crashed else 0


def _timeline(
    polls: list[PollReport],
    phases: list[tuple[str, float, float]],
    events: list[dict[str, Any]],
    requests: int,
    failed: int,
    t0: float,
) -> dict[str, Any]:
    """What the demo saw, as --json writes it and the plot reads it (times from t0)."""
    return {
        "settings": {
            "pollIntervalSeconds": POLL_SECONDS,
            "targetQueueDepth": TARGET_QUEUE,
            "scaleDownStabilizationSeconds": DOWN_WINDOW_SECONDS,
            "maxReplicas": MAX_REPLICAS,
            "maxTokens": MAX_TOKENS,
            "runtime": "random:tiny, --max-num-seqs 2, --num-threads 1",
        },
        "phases": [{"load": p, "start": s, "end": e} for p, s, e in phases],
        "polls": [
            {
                "t": p.at - t0,
                "waiting": p.total_waiting,
                "running": p.total_running,
                "kv_usage": p.mean_kv_usage,
                "current": p.current,
                "desired": p.desired,
                "scaled": p.scaled,
                "reason": p.reason,
                "pods_reporting": p.pods_reporting,
                "pods_missing": p.pods_missing,
            }
            for p in polls
        ],
        "pods": events,
        "requests": {"total": requests, "failed": failed},
    }


_ISVC = "kvfleet.dev/v1alpha1/inferenceservices"


def _inference_service() -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "bundled", "servedName": NAME},
            "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
            "runtime": {
                "maxNumSeqs": 2,
                "maxModelLen": 512,
                "drainTimeoutSeconds": 60,
                # The last --model wins: a tiny random model (the bundled tokenizer) keeps the
                # demo light; 1 MiB of KV cache (1024 tokens) makes its usage visible.
                "extraArgs": [
                    "--model",
                    "random:tiny",
                    "--num-threads",
                    "1",
                    "--kv-cache-memory",
                    "1MiB",
                ],
            },
            "autoscaling": {
                "enabled": True,
                "minReplicas": 1,
                "maxReplicas": MAX_REPLICAS,
                "targetQueueDepth": TARGET_QUEUE,
                "pollIntervalSeconds": POLL_SECONDS,
                "scaleDownStabilizationSeconds": DOWN_WINDOW_SECONDS,
            },
        },
    }
