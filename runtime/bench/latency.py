"""`kvfleet bench latency`: how fast one request (or a few) is served, against the bounds the
machine sets, measured in the same run.

- Decode: a batch of 1, 4 and 8 sequences decoding together through the engine (scheduler,
  forward, sampling, detokenizing: everything but HTTP); the median step time in steady state
  is the time per output token of each sequence. Its bound is the weights one step must stream
  (every layer's projections and norms, the LM head) divided by the memory read rate this
  command measures (a large float32 sum).
- Time to first token of a prompt alone (128, 512 and 2048 tokens), against its compute bound:
  the prompt's FLOPs (projections, causal attention, one row of logits) divided by the GEMM
  rate this command measures (the same one MFU divides by in `bench throughput`).

Rates are measured at both ends of the run, and the read rate also just before and after each
decode row; the highest of them counts, so a bound is never flattered by a slow phase of a
shared host. Each decode row also reports its step against the read rate probed beside it
(`ratio_to_beside_bound`): where the host's memory speed changes within minutes, the state
that row ran in. Every figure names the kernel path that produced it
(AMX, AVX512-BF16, AVX-512 float32, AVX2 or torch) and whether decode steps ran the fused
one-call step; the host's CPU flags are reported with them.

`--baseline library` also runs every batch size and prompt with kvfleet's own GEMMs switched
off (every projection on torch's oneDNN or MKL, and so op by op, no fused step), taking turns
with the default path: what those kernels gain, measured in the same run. `--baseline two-call`
runs every batch size again with decode steps in two calls (the fused stack, then the final
norm, LM head and sampling from Python) instead of one from token ids to logits: what the one
call gains, in turns. Each of those is a kernel policy of its own that the model runs in its
turns (`kernel_policies`). `--baseline dequantized` loads a quantized model a second time with
`--quantization none` and runs every row on that engine in turns: what keeping the weights
quantized gains. The report and its table are `latency_report`'s. With `--speculative-config`,
it measures speculative decoding instead (speculative.py): output tokens/s of single streams
and of a full batch, speculation on against off, in turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvfleet.runtime.bench import kernel_policies, speculative
from kvfleet.runtime.bench.latency_report import (
    decode_rows,
    decode_weight_bytes,
    print_report,
    ttft_rows,
)
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args

DEFAULT_SEQUENCES = "1,4,8"
DEFAULT_PROMPTS = "128,512,2048"
READ_PROBE_BYTES = 512 * 1024**2  # far past any last-level cache


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "latency",
        help="time per output token at 1/4/8 sequences and TTFT, against the machine's bounds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sequences",
        default=DEFAULT_SEQUENCES,
        help=f"decode batch sizes, comma-separated (default {DEFAULT_SEQUENCES})",
    )
    p.add_argument(
        "--context",
        type=int,
        default=128,
        help="prompt tokens of each decoding sequence (default 128)",
    )
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=4,
        help="decode steps run before timing, per batch size (default 4)",
    )
    p.add_argument(
        "--prompts",
        default=DEFAULT_PROMPTS,
        help=f"prompt lengths whose TTFT is timed, comma-separated (default {DEFAULT_PROMPTS})",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed prompts per length (default 3)")
    p.add_argument(
        "--baseline",
        choices=("none", "library", "two-call", "dequantized"),
        default="none",
        help="library: also time each row with kvfleet's GEMMs off (torch's oneDNN/MKL, op by "
        "op), in turns with the default path; two-call: each decode row with decode steps in "
        "two calls (the fused stack, then the LM head from Python) instead of one call from "
        "token ids to logits, in turns; dequantized: each row on a second engine of the same "
        "quantized model loaded with --quantization none (in --dtype), in turns",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    speculative.add_speculative_bench_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


@dataclass(slots=True)
class _StepTimes:
    """Per-step wall times the wrapped engine parts record."""

    forward: list[float] = field(default_factory=list)
    logits: list[float] = field(default_factory=list)
    fused: int = 0


def _parse_counts(flag: str, text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{flag}: comma-separated counts of at least 1, got {text!r}")
    return counts


def read_probe(device: Any, nbytes: int = READ_PROBE_BYTES) -> Any:
    """The buffer `measure_read_rate` sums: on CPU on the same huge-page memory as the weights
    (`dispatch.memory_arena`), since on 4 KiB pages the sum reads up to a third slower and the
    bound would flatter the step."""
    import torch
    from kvfleet.kernels import dispatch

    arena = dispatch.memory_arena(device)
    if arena is not None:
        return arena.empty((nbytes // 4,), torch.float32).fill_(1.0)
    return torch.ones(nbytes // 4, dtype=torch.float32, device=device)


def measure_read_rate(device: Any, probe: Any, repeats: int = 5) -> float:
    """Best bytes/s of a float32 sum over `probe` (a `read_probe`): the rate weights can stream
    from memory."""
    import torch

    x, nbytes = probe, probe.numel() * 4
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass also faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


class _Probe:
    """Wraps the model's forward and LM head, the fused decode step, the one-call CPU step and
    the CUDA-graph replay of one engine to time each step's parts; `close` puts them back. On a
    GPU each part is timed to its end (synchronised), not to the return of its launches. A
    one-call step (token ids to logits) counts as fused and as forward: its LM head is in it."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.times = engine, _StepTimes()
        model = engine.model
        self._forward, self._logits = model.forward, model.compute_logits
        self._stack = engine.runner.stack
        self._graphs = engine.runner.graphs
        times = self.times
        sync = _synchronizer(engine.device)

        def timed(fn: Any, into: list[float]) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                sync()
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                sync()
                into.append(time.perf_counter() - t)
                return out

            return wrapper

        def counted(fn: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                times.fused += 1
                return fn(*args, **kwargs)

            return wrapper

        model.forward = timed(self._forward, times.forward)
        model.compute_logits = timed(self._logits, times.logits)
        # A fused decode step, on CPU one C call and on a GPU one graph replay, is counted.
        fused = self._stack if self._stack is not None else self._graphs
        if fused is not None:
            fused.run = counted(timed(fused.run, times.forward) if self._graphs else fused.run)
        one_call = engine.runner.one_call
        if one_call is not None:
            one_call.run = counted(timed(one_call.run, times.forward))
        self._wrapped = [w for w in (fused, one_call) if w is not None]

    def reset(self) -> None:
        self.times.forward.clear()
        self.times.logits.clear()
        self.times.fused = 0

    def close(self) -> None:
        model = self.engine.model
        del model.forward, model.compute_logits  # the class's methods again
        for wrapped in self._wrapped:
            del wrapped.run  # the class's method again


def _synchronizer(device: Any) -> Any:
    """A call that waits for the device's queued work (nothing to wait for on CPU)."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _prompt(rng: Any, pool: Any, tokens: int) -> list[int]:
    return rng.choice(pool, size=tokens).tolist()


def _token_pool(engine: Any) -> Any:
    import numpy as np

    special = set(getattr(engine.tokenizer, "all_special_ids", []) or [])
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    return np.array([t for t in range(vocab) if t not in special], dtype=np.int64)


def _projection_weight(engine: Any) -> Any:
    """The first layer's qkv weight as the model holds it (plain or prepacked)."""
    return engine.model.layers[0].qkv_proj


def _weights_on_huge_pages(engine: Any) -> bool | None:
    """Whether the weights a CPU decode step streams lie on huge-page memory (None on a GPU):
    the first layer's qkv weight, in the layout kvfleet's GEMM reads."""
    import torch
    from kvfleet.kernels.cpu import huge_pages

    if engine.device.type != "cpu":
        return None
    weight = _projection_weight(engine)
    weight = getattr(weight, "tiles", weight)  # a PackedLinear: the tiles, if kvfleet's GEMM runs
    weight = getattr(weight, "qweight", weight)  # a QuantizedWeight: its packed values
    return isinstance(weight, torch.Tensor) and huge_pages.on_huge_pages(weight)


def measure_decode(engine: Any, n: int, context: int, steps: int, warmup: int, rng, pool) -> dict:
    """Median step time of `n` sequences decoding together, after `warmup` decode steps."""
    from kvfleet.runtime.engine.sampling_params import SamplingParams

    engine.kv.reset_prefix_cache()
    params = SamplingParams(max_tokens=warmup + steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"latency-decode-{n}-{i}", _prompt(rng, pool, context), params)
    probe = _Probe(engine)
    sched = engine.scheduler
    walls: list[float] = []
    parts: list[tuple[float, float]] = []
    fused = 0
    try:
        while engine.has_unfinished_requests():
            # A decode-only step of all n: nothing waiting, every running sequence one token
            # short of its length (its prompt done).
            decoding = sched.num_waiting == 0 and len(sched.running) == n
            decoding = decoding and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in sched.running
            )
            probe.reset()
            t = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t
            if decoding:
                walls.append(wall)
                parts.append((sum(probe.times.forward), sum(probe.times.logits)))
                fused += probe.times.fused if len(walls) > warmup else 0
    finally:
        probe.close()
    timed, timed_parts = walls[warmup:], parts[warmup:]
    if not timed:
        raise RuntimeError(f"no steady decode steps at {n} sequences (raise --decode-steps)")
    forward = statistics.median(p[0] for p in timed_parts)
    logits = statistics.median(p[1] for p in timed_parts)
    median = statistics.median(timed)
    return {
        "steps": len(timed),
        "step_median_ms": median * 1e3,
        "step_min_ms": min(timed) * 1e3,
        "forward_median_ms": forward * 1e3,
        "logits_median_ms": logits * 1e3,
        "other_median_ms": statistics.median(
            w - f - g for w, (f, g) in zip(timed, timed_parts, strict=True)
        )
        * 1e3,
        "fused_steps": fused,
    }


def measure_ttft(engine: Any, tokens: int, repeats: int, rng, pool) -> list[float]:
    """Seconds from adding a prompt of `tokens` tokens to its first token, the engine otherwise
    idle, `repeats` times (fresh prompts: no prefix-cache hits)."""
    from kvfleet.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    for i in range(repeats):
        engine.kv.reset_prefix_cache()
        prompt = _prompt(rng, pool, tokens)
        t = time.perf_counter()
        engine.add_request(f"latency-ttft-{tokens}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        out.append(time.perf_counter() - t)
    return out


def measure(args: argparse.Namespace) -> dict:
    """Every decode row and prompt of the run, with its baseline's in turns where one is asked
    for, and the machine's bounds: the report `latency_report` prints."""
    import numpy as np
    import torch
    from kvfleet.kernels.cpu import cpu_features
    from kvfleet.runtime.bench.throughput import _device_name, measure_matmul_flops
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    sequences = _parse_counts("--sequences", args.sequences)
    prompts = _parse_counts("--prompts", args.prompts)
    if min(args.context, args.decode_steps, args.repeats) < 1 or args.warmup_steps < 0:
        raise ValueError("--context, --decode-steps and --repeats: at least 1; --warmup-steps: 0+")
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    longest = max(max(prompts) + 1, args.context + args.warmup_steps + args.decode_steps + 1)
    if longest > engine.max_model_len:
        raise ValueError(
            f"--prompts/--context: {longest} tokens exceed max_model_len {engine.max_model_len}"
        )
    mc, device, model = engine.model_config, engine.device, engine.model
    elem = torch.empty((), dtype=engine.dtype).element_size()
    weight_bytes = decode_weight_bytes(mc, elem, model)
    print(
        f"device {engine.device}, dtype {engine.dtype}, threads {torch.get_num_threads()}",
        file=sys.stderr,
    )
    probe = read_probe(device)  # one buffer for every probe of the run
    read_first = measure_read_rate(device, probe)
    gemm_first = measure_matmul_flops(engine.dtype, device)
    engine.warm_up()
    rng = np.random.default_rng(config.seed)
    pool = _token_pool(engine)
    weight = _projection_weight(engine)
    max_batched = engine.scheduler.config.max_num_batched_tokens

    # The baseline: a policy of this engine's model (library, two-call), or another engine of
    # the same model loaded dequantized, running its own. Prompts are compared against the
    # library's GEMMs and the dequantized model, not two-call (the one call is for decodes).
    base_engine = engine
    if args.baseline == "dequantized":
        base_engine = LLMEngine(replace(config, quantization="none"))
        base_engine.warm_up()
    base_policy = {
        "library": kernel_policies.library_gemms,
        "two-call": kernel_policies.two_calls,
    }.get(args.baseline, lambda p: p)(base_engine.model.kernels.policy)
    timed_prompts = args.baseline in ("library", "dequantized")

    def decode(e: Any, n: int) -> dict:
        row = measure_decode(e, n, args.context, args.decode_steps, args.warmup_steps, rng, pool)
        return {**row, "gemm_path": e.model.kernels.linear_path(_projection_weight(e), n)}

    # Default path and baseline take turns per batch size and per prompt: each comparison is
    # made within seconds on a host whose speed drifts over minutes.
    decode_raw, decode_base, beside = [], {}, {}
    base_weight = _projection_weight(base_engine)
    for n in sequences:
        before = measure_read_rate(device, probe)
        decode_raw.append((n, decode(engine, n)))
        beside[n] = max(before, measure_read_rate(device, probe))
        if args.baseline != "none":
            with kernel_policies.running(base_engine.model, base_policy):
                decode_base[n] = decode(base_engine, n)
    ttft_raw, ttft_base = [], {}
    for t in prompts:
        times, base = [], []
        for _ in range(args.repeats):
            times += measure_ttft(engine, t, 1, rng, pool)
            if timed_prompts:
                with kernel_policies.running(base_engine.model, base_policy):
                    base += measure_ttft(base_engine, t, 1, rng, pool)
        ttft_raw.append((t, times, model.kernels.linear_path(weight, min(t, max_batched))))
        if timed_prompts:
            with kernel_policies.running(base_engine.model, base_policy):
                path = base_engine.model.kernels.linear_path(base_weight, min(t, max_batched))
            ttft_base[t] = {
                "ttft_median_ms": statistics.median(base) * 1e3,
                "ttft_min_ms": min(base) * 1e3,
                "gemm_path": path,
            }

    read_last = measure_read_rate(device, probe)
    del probe
    gemm_last = measure_matmul_flops(engine.dtype, device)
    read_rate = max(read_first, read_last, *beside.values())
    gemm_rate = max(gemm_first, gemm_last)
    bound_ms = weight_bytes / read_rate * 1e3
    decode = decode_rows(decode_raw, decode_base, beside, args.context, weight_bytes, bound_ms)
    ttft = ttft_rows(ttft_raw, ttft_base, mc, gemm_rate)
    single = next((row for row in decode if row.sequences == 1), None)
    return {
        "model": config.model,
        "device": _device_name(device),
        "cpu_flags": cpu_features.kernel_flags() if device.type == "cpu" else [],
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "kernel_path": model.kernels.linear_path(weight, 1),
        "baseline": args.baseline,
        "weight_bytes": weight_bytes,
        "weights_on_huge_pages": _weights_on_huge_pages(engine),
        "read_rate_bytes_per_s": read_rate,
        "read_rate_first_last": [read_first, read_last],
        "weight_stream_bound_ms": bound_ms,
        "gemm_flops_per_s": gemm_rate,
        "gemm_flops_first_last": [gemm_first, gemm_last],
        "single_stream_ratio": single.ratio_to_bound if single else None,
        "decode": [asdict(r) for r in decode],
        "ttft": [asdict(r) for r in ttft],
    }


def run(args: argparse.Namespace) -> int:
    try:
        config = engine_config_from_args(args)
        if config.speculative_config is not None:  # speculation on against off (speculative.py)
            report = speculative.measure_speculative(config, args)
        else:
            report = measure(args)
    except ValueError as exc:
        print(f"kvfleet bench latency: {exc}", file=sys.stderr)
        return 1
    (speculative.print_speculative if config.speculative_config is not None else print_report)(
        report
    )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0
