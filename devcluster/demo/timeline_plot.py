"""The demo's timeline drawn: queue depth, KV usage and replicas over time (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
