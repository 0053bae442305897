"""`kvfleet bench latency`'s report: the bounds the machine sets (weight bytes a decode step
streams, a prompt's FLOPs), the rows the measurements make against them (each with the kernel
path that produced it and, with a baseline, its speedup over it), and the printed table. The
JSON document is these rows as dicts."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class DecodeRow:
    sequences: int
    context_tokens: int
    steps: int  # timed steady-state steps
    step_median_ms: float  # = time per output token of each sequence
    step_min_ms: float
    # Where a step's time went (medians): the model's layers and final norm, the LM head, and
    # everything else (scheduling, input tensors, sampling, detokenizing).
    forward_median_ms: float
    logits_median_ms: float
    other_median_ms: float
    bound_ms: float  # weight bytes / read rate
    ratio_to_bound: float
    # The read rate probed just before and after this row (the better of the two) and the
    # step over the bound at that rate: on a host whose memory speed changes within minutes,
    # the state this row ran in. The run's read rate (bound_ms) is the best of every probe.
    read_rate_beside: float
    ratio_to_beside_bound: float
    over_one_sequence: float | None  # this step's median / the 1-sequence step's
    gemm_path: str  # the kernel running the step's projections
    fused_steps: int  # timed steps that ran as one call (CPU: the fused C step; GPU: a graph)
    # With --baseline library: the same batch with kvfleet's GEMMs off (step_median_ms,
    # step_min_ms, gemm_path, fused_steps) and this row's speedup over it (median over median).
    baseline: dict | None = None
    speedup_over_baseline: float | None = None


@dataclass(slots=True)
class TtftRow:
    prompt_tokens: int
    repeats: int
    ttft_median_ms: float
    ttft_min_ms: float
    prefill_gflop: float
    bound_ms: float  # prefill FLOPs / GEMM rate
    ratio_to_bound: float
    gemm_path: str  # the kernel running the prompt's projections (its largest step)
    baseline: dict | None = None  # as DecodeRow's: ttft_median_ms, ttft_min_ms, gemm_path
    speedup_over_baseline: float | None = None


# What a decode row keeps of its baseline's measurement.
_BASELINE_KEYS = ("step_median_ms", "step_min_ms", "gemm_path", "fused_steps")


def decode_weight_bytes(mc: Any, elem_size: int, model: Any = None) -> int:
    """Bytes of weights one decode step reads: all of them but an untied input embedding table
    (of which a step reads one row per sequence). With `model` holding quantized projections,
    their bytes as held (packed values, scales, offsets) stand in for their plain size."""
    from kvfleet.kernels.quant_weight import QuantizedWeight
    from kvfleet.runtime.models.llama import PROJECTIONS

    total = mc.step_parameters() * elem_size
    if model is None:
        return total
    held = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
    held.append(model.lm_head)
    for w in held:
        if isinstance(w, QuantizedWeight):
            total += w.nbytes() - w.out_features * w.in_features * elem_size
    return total


def prefill_flops(mc: Any, tokens: int) -> int:
    """Multiply-adds x 2 of a prompt of `tokens` tokens alone: every projection per token,
    causal attention (QK^T and PV over the positions each token sees), and the logits of the
    last token only (the engine computes no others)."""
    h, d = mc.hidden_size, mc.head_dim
    per_token = (
        h * (mc.num_heads + 2 * mc.num_kv_heads) * d
        + mc.num_heads * d * h
        + 3 * h * mc.intermediate_size
    )
    attended = tokens * (tokens + 1) // 2
    attention = 2 * mc.num_heads * d * attended  # QK^T and PV, one multiply-add each
    return 2 * (mc.num_layers * (per_token * tokens + attention) + mc.vocab_size * h)


def decode_rows(
    measured: list[tuple[int, dict]],
    baselines: dict[int, dict],
    beside: dict[int, float],
    context: int,
    weight_bytes: int,
    bound_ms: float,
) -> list[DecodeRow]:
    """One row per batch size from its measurement (`measure_decode`'s fields and its
    gemm_path), the read rate probed beside it and, where one ran, its baseline's."""
    one = next((r["step_median_ms"] for n, r in measured if n == 1), None)
    rows = []
    for n, r in measured:
        base = baselines.get(n)
        rows.append(
            DecodeRow(
                sequences=n,
                context_tokens=context,
                bound_ms=bound_ms,
                ratio_to_bound=r["step_median_ms"] / bound_ms,
                read_rate_beside=beside[n],
                ratio_to_beside_bound=r["step_median_ms"] / (weight_bytes / beside[n] * 1e3),
                over_one_sequence=r["step_median_ms"] / one if one else None,
                baseline={k: base[k] for k in _BASELINE_KEYS} if base else None,
                speedup_over_baseline=base["step_median_ms"] / r["step_median_ms"]
                if base
                else None,
                **r,
            )
        )
    return rows


def ttft_rows(
    measured: list[tuple[int, list[float], str]],
    baselines: dict[int, dict],
    mc: Any,
    gemm_rate: float,
) -> list[TtftRow]:
    """One row per prompt length from its times (seconds) and gemm_path and, where one ran,
    its baseline's (`ttft_median_ms`, `ttft_min_ms`, `gemm_path`)."""
    rows = []
    for tokens, times, path in measured:
        flops = prefill_flops(mc, tokens)
        median = statistics.median(times)
        base = baselines.get(tokens)
        rows.append(
            TtftRow(
                prompt_tokens=tokens,
                repeats=len(times),
                ttft_median_ms=median * 1e3,
                ttft_min_ms=min(times) * 1e3,
                prefill_gflop=flops / 1e9,
                bound_ms=flops / gemm_rate * 1e3,
                ratio_to_bound=median / (flops / gemm_rate),
                gemm_path=path,
                baseline=base,
                speedup_over_baseline=base["ttft_median_ms"] / (median * 1e3) if base else None,
            )
        )
    return rows


def print_report(report: dict) -> None:
    """The report as a table: the machine, then a line per decode row and per prompt (and one
    per baseline under its row)."""
    flags = " ".join(report["cpu_flags"]) or "-"
    print(
        f"model {report['model']} ({report['dtype']}), {report['device']}, "
        f"{report['threads']} threads, flags: {flags}"
    )
    pages = {True: " (2 MiB pages)", False: " (4 KiB pages)"}.get(
        report["weights_on_huge_pages"], ""
    )
    print(
        f"weights {report['weight_bytes'] / 1e6:.1f} MB{pages} at "
        f"{report['read_rate_bytes_per_s'] / 1e9:.1f} GB/s: bound {report['weight_stream_bound_ms']:.2f} ms/step; GEMM rate "
        f"{report['gemm_flops_per_s'] / 1e12:.3f} TFLOP/s"
    )
    print(
        f"{'seqs':>5} {'ms/token':>9} {'min':>7} {'forward':>8} {'logits':>7} {'other':>6} "
        f"{'x bound':>8} {'(beside)':>14} {'x 1 seq':>8} {'fused':>6}  path"
    )
    for r in report["decode"]:
        over = f"{r['over_one_sequence']:.2f}" if r["over_one_sequence"] else "-"
        near = f"{r['ratio_to_beside_bound']:.2f} @{r['read_rate_beside'] / 1e9:.0f}GB/s"
        print(
            f"{r['sequences']:>5} {r['step_median_ms']:>9.2f} {r['step_min_ms']:>7.2f} "
            f"{r['forward_median_ms']:>8.2f} {r['logits_median_ms']:>7.2f} "
            f"{r['other_median_ms']:>6.2f} {r['ratio_to_bound']:>8.2f} {near:>14} {over:>8} "
            f"{r['fused_steps']:>3}/{r['steps']:<3} {r['gemm_path']}"
        )
        if r["baseline"]:
            b = r["baseline"]
            print(
                f"{'':>5} {b['step_median_ms']:>9.2f} {b['step_min_ms']:>7.2f}  baseline "
                f"{report['baseline']} ({b['gemm_path']}, fused {b['fused_steps']}/{r['steps']}): "
                f"{r['speedup_over_baseline']:.2f}x"
            )
    print(f"{'prompt':>7} {'TTFT ms':>9} {'min':>8} {'bound':>8} {'x bound':>8}  path")
    for r in report["ttft"]:
        print(
            f"{r['prompt_tokens']:>7} {r['ttft_median_ms']:>9.1f} {r['ttft_min_ms']:>8.1f} "
            f"{r['bound_ms']:>8.1f} {r['ratio_to_bound']:>8.2f}  {r['gemm_path']}"
        )
        if r["baseline"]:
            b = r["baseline"]
            print(
                f"{'':>7} {b['ttft_median_ms']:>9.1f} {b['ttft_min_ms']:>8.1f}  baseline "
                f"({b['gemm_path']}): {r['speedup_over_baseline']:.2f}x"
            )
