"""`kvfleet demo autoscale`: watch the autoscaler work, on one machine, with real runtime pods.

Everything runs here: the Kubernetes API emulator of the test suite, the operator (kopf, with
the autoscaler), the kubelet simulator (each replica is a real `kvfleet serve` process on its
own 127.0.0.x address, serving `random:tiny`) and a request load in three phases — light,
heavy, light. One line per autoscaler poll shows queue, KV usage and replicas; at the end the
timeline is drawn (queue depth, KV usage, replicas over time) and optionally saved as JSON.

It needs a source checkout with the test extras (`pip install -e '.[test]'`): the emulator is
tests/operator/emulator.py (kmock), the plot needs matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Run the autoscaler end to end on this machine and draw what it did: an in-process Kubernetes
API emulator, the kvfleet operator, real `kvfleet serve` pods (random tiny model, one CPU
thread each, on 127.0.0.2, 127.0.0.3, ...) and a light → heavy → light request load. Prints a
line per autoscaler poll and writes the timeline plot. Needs a source checkout with the test
extras installed (pip install -e '.[test]')."""

NAMESPACE = "default"
NAME = "demo"
POLL_SECONDS = 1
DOWN_WINDOW_SECONDS = 10
TARGET_QUEUE = 2
MAX_REPLICAS = 3
MAX_TOKENS = 200
HEAVY_CONCURRENCY = 12


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `demo autoscale` to the kvfleet CLI."""
    demo = subparsers.add_parser(
        "demo",
        help="demonstrations that run on one machine",
        description="Demonstrations that run on one machine.",
    )
    sub = demo.add_subparsers(dest="demo", required=True, metavar="DEMO")
    p = sub.add_parser(
        "autoscale",
        help="scale real runtime pods on queue depth and KV usage, and plot it",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--duration",
        type=float,
        default=75.0,
        metavar="S",
        help="seconds of load once the first pod is ready (default 75; at least 30)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("autoscaling-timeline.png"),
        metavar="PNG",
        help="where to write the timeline plot (default autoscaling-timeline.png)",
    )
    p.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="also write the timeline as JSON"
    )
    p.set_defaults(func=run)


def _emulator_module() -> Any:
    """tests/operator/emulator.py of this source checkout (the demo's API server)."""
    import importlib.util

    import kvfleet.operator

    path = Path(kvfleet.operator.__file__).resolve().parents[1] / "tests/operator/emulator.py"
    if not path.is_file():
        raise RuntimeError(f"{path} not found: the demo runs from a source checkout of kvfleet")
    spec = importlib.util.spec_from_file_location("kvfleet_demo_emulator", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every request succeeded and no pod crashed."""
    import asyncio
    import logging

    if args.duration < 30:
        print("kvfleet demo autoscale: error: --duration must be >= 30 seconds", file=sys.stderr)
        return 2
    try:
        import kmock  # noqa: F401
        import matplotlib  # noqa: F401

        emulator = _emulator_module()
    except (ImportError, RuntimeError) as exc:
        print(
            f"kvfleet demo autoscale: error: {exc}\n(the demo needs a source checkout with "
            "the test extras: pip install -e '.[test]')",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("kopf", "aiohttp.access", "kvfleet.kubelet_sim", "kvfleet.autoscaler"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        return asyncio.run(_demo(args, emulator))
    except KeyboardInterrupt:
        print("interrupted; every pod was stopped", file=sys.stderr)
        return 130


async def _demo(args: argparse.Namespace, emulator_module: Any) -> int:
    import asyncio
    import functools
    import json
    import os
    import tempfile
    import threading
    import time

    import aiohttp
    import aiohttp.test_utils
    import kmock
    import yaml
    from kvfleet.operator.autoscale_loop import (
        OBSERVERS_SETTING,
        RUNTIME_PORT_SETTING,
        PollReport,
    )
    from kvfleet.operator.demo_load import EndpointLoad
    from kvfleet.operator.handlers import OperatorConfig, build_registry
    from kvfleet.operator.kopf_thread import start_kopf_thread
    from kvfleet.operator.kube_api import KubeApi
    from kvfleet.operator.kubelet_sim import KubeletSim

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

    emulator = emulator_module.RealisticEmulator()
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
    timeline = {
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
        "requests": {"total": len(results), "failed": len(failed)},
    }
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


def plot_timeline(timeline: dict[str, Any], path: Path) -> None:
    """Queue depth, KV usage and replicas over time, heavy-load phase shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    polls = timeline["polls"]
    t = [p["t"] for p in polls]
    fig, (ax_q, ax_kv, ax_r) = plt.subplots(3, 1, sharex=True, figsize=(9, 7))
    ax_q.plot(t, [p["waiting"] for p in polls], label="waiting (all pods)", color="tab:red")
    ax_q.plot(t, [p["running"] for p in polls], label="running", color="tab:gray", lw=1)
    ax_q.axhline(
        timeline["settings"]["targetQueueDepth"],
        ls=":",
        color="tab:red",
        lw=1,
        label="target per replica",
    )
    ax_q.set_ylabel("requests")
    ax_q.legend(loc="upper right", fontsize=8)
    kv = [None if p["kv_usage"] is None else p["kv_usage"] * 100 for p in polls]
    ax_kv.plot(t, kv, color="tab:blue", label="KV cache usage (mean)")
    ax_kv.axhline(80, ls=":", color="tab:blue", lw=1, label="target 80%")
    ax_kv.set_ylabel("KV usage %")
    ax_kv.set_ylim(0, 100)
    ax_kv.legend(loc="upper right", fontsize=8)
    ax_r.step(t, [p["desired"] for p in polls], where="post", label="desired", color="tab:green")
    ready_t, ready_n, serving = [0.0], [0], set()
    for e in timeline["pods"]:
        if e["event"] == "ready":
            serving.add(e["pod"])
        elif e["event"] in ("terminating", "crashed"):
            serving.discard(e["pod"])
        else:
            continue
        ready_t.append(e["t"])
        ready_n.append(len(serving))
    if t:
        ready_t.append(t[-1])
        ready_n.append(len(serving))
    ax_r.step(ready_t, ready_n, where="post", label="ready pods", color="tab:olive", ls="--")
    ax_r.set_ylabel("replicas")
    ax_r.set_xlabel("seconds")
    ax_r.set_yticks(range(0, timeline["settings"]["maxReplicas"] + 2))
    ax_r.legend(loc="upper right", fontsize=8)
    for ax in (ax_q, ax_kv, ax_r):
        for phase in timeline["phases"]:
            if phase["load"] == "heavy":
                ax.axvspan(phase["start"], phase["end"], color="orange", alpha=0.12)
        ax.grid(alpha=0.3)
    ax_q.set_title("kvfleet autoscaler: heavy load shaded (real runtime pods, one machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
