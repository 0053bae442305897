"""Plots for `kvfleet bench serve`: latency CDFs per run, and a concurrency sweep."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet.runtime.bench.serve_client import RunResult

_LATENCIES = (
    ("ttft", "time to first token"),
    ("itl", "inter-token latency"),
    ("e2e", "end-to-end latency"),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(runs: dict[str, RunResult], path: str) -> None:
    """One panel per latency (seconds, log scale), one CDF line per labelled run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, title) in zip(axes, _LATENCIES, strict=True):
        for label, run in runs.items():
            xs = sorted(run.samples.get(key, []))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # 2×10⁰ 3×10⁰… labels collide
        ax.set_xlabel("seconds")
        ax.set_title(title)
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples")
    axes[-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_concurrency_sweep(runs: list[RunResult], path: str) -> None:
    """Output tokens/s and p50/p99 latencies against the number of requests in flight."""
    plt = _pyplot()
    conc = [r.concurrency for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(conc, [r.output_tokens_per_s for r in runs], marker="o")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrency (requests in flight)")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput")
    ax1.grid(alpha=0.3)
    for attr, label in (
        ("ttft_p50", "TTFT p50"),
        ("ttft_p99", "TTFT p99"),
        ("itl_p50", "ITL p50"),
        ("itl_p99", "ITL p99"),
    ):
        ax2.plot(conc, [getattr(r, attr) for r in runs], marker="o", label=label)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrency (requests in flight)")
    ax2.set_ylabel("seconds")
    ax2.set_title("latency")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
