"""`kvfleet bench gemm-rows`: where kvfleet's own projection kernel should hand a step's GEMMs
over to the library one, measured on the steps of a real run rather than on one shape. In bf16
that is `cpu_gemm` against oneDNN (`cpu_gemm.MAX_ROWS` for its AMX engine, `VECTOR_MAX_ROWS`
for its AVX512-BF16 one, whichever runs here); in float32, the AVX-512 kernel for decode-sized
steps against MKL's F.linear (`cpu_gemm_f32.MAX_ROWS`).

Runs the standard workload offline (as `bench throughput --baseline none`, same engine flags)
and runs the model's forward of every step that has more rows than the lowest candidate once
per candidate `MAX_ROWS`, back to back, in an order that rotates from step to step: each
comparison is made within the same fraction of a second, on a host whose speed drifts by up to
2x over minutes, which whole-run A/Bs could not see through. Running a forward again is safe: it
rewrites the same slots of the KV cache, and the step keeps the last run's cache and output.

Reports, per candidate, the summed forward time of the compared steps, and per step its time
over the first candidate's: the median and how many steps were faster, overall and by row
count. CPU only: bfloat16 where the AMX kernel runs, float32 where the AVX-512 one does
(elsewhere there is nothing to route).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from kvfleet.runtime.engine.config import add_engine_args, engine_config_from_args

# Keyed by the limit a run moves. AMX: its old and current limits. AVX512-BF16: none (oneDNN
# throughout) and the current limit. float32: none (the kernel needs 4 rows) and the current
# limit.
DEFAULT_CANDIDATES = {"MAX_ROWS": "96,1024", "VECTOR_MAX_ROWS": "0,1024", "float32": "3,128"}
# Row-count buckets of the report: decode batches (small, serving-sized, offline-sized), a
# prompt beside decodes, full prefill steps.
BUCKETS = (
    (1, 16), (17, 32), (33, 64), (65, 255), (256, 511), (512, 1023), (1024, 2047), (2048, 1 << 30),
)  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gemm-rows",
        help="kvfleet's GEMM vs the library's hand-over points, paired on each step of a run "
        "(CPU: AMX in bf16, AVX-512 in float32)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--candidates",
        default=None,
        help="row limits to compare, the first the reference (default: bf16 on AMX "
        f"{DEFAULT_CANDIDATES['MAX_ROWS']}, bf16 on AVX512-BF16 "
        f"{DEFAULT_CANDIDATES['VECTOR_MAX_ROWS']}, float32 {DEFAULT_CANDIDATES['float32']})",
    )
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    add_engine_args(p)
    p.set_defaults(func=run)


def parse_candidates(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if len(values) < 2 or min(values) < 0 or len(set(values)) != len(values):
        raise ValueError(
            f"--candidates: at least two distinct row counts >= 0, comma-separated, got {text!r}"
        )
    return values


class PairedForward:
    """Stands in for the model's forward: steps with more rows than the lowest candidate run
    once per candidate (rotating order) and are timed; the rest run once, untimed. The
    candidates set attribute `limit` of kernel module `gemm` (default cpu_gemm's MAX_ROWS)."""

    def __init__(
        self, forward: Any, candidates: list[int], gemm: Any = None, limit: str = "MAX_ROWS"
    ) -> None:
        from kvfleet.kernels.cpu import cpu_gemm

        self._gemm, self._limit = gemm or cpu_gemm, limit
        self._forward = forward
        self.candidates = candidates
        self.rows: list[int] = []
        self.seconds: list[list[float]] = []  # per compared step, per candidate (input order)

    def __call__(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        rows = int(input_ids.shape[0])
        if rows <= min(self.candidates):
            return self._forward(input_ids, *args, **kwargs)
        n = len(self.candidates)
        turn = len(self.rows) % n
        times = [0.0] * n
        default = getattr(self._gemm, self._limit)
        out = None
        try:
            for i in [(turn + j) % n for j in range(n)]:
                setattr(self._gemm, self._limit, self.candidates[i])
                start = time.perf_counter()
                out = self._forward(input_ids, *args, **kwargs)
                times[i] = time.perf_counter() - start
        finally:
            setattr(self._gemm, self._limit, default)
        self.rows.append(rows)
        self.seconds.append(times)
        return out

    def report(self) -> dict[str, Any]:
        """Totals per candidate and each later candidate's per-step ratio to the first."""
        out: dict[str, Any] = {
            "steps_compared": len(self.rows),
            "forward_s": {
                str(c): sum(t[i] for t in self.seconds) for i, c in enumerate(self.candidates)
            },
            "ratios": {},
        }
        for i, c in enumerate(self.candidates[1:], start=1):
            per_step = [(r, t[i] / t[0]) for r, t in zip(self.rows, self.seconds, strict=True)]
            out["ratios"][str(c)] = {
                "all": _summary([q for _, q in per_step]),
                "by_rows": [
                    {
                        "rows_from": lo,
                        "rows_to": hi,
                        **_summary([q for r, q in per_step if lo <= r <= hi]),
                    }
                    for lo, hi in BUCKETS
                    if any(lo <= r <= hi for r, _ in per_step)
                ],
            }
        return out


def _summary(ratios: list[float]) -> dict[str, Any]:
    return {
        "steps": len(ratios),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "faster_steps": sum(q < 1.0 for q in ratios),
    }


def routed_kernel(device: Any, dtype: Any) -> tuple[Any, str]:
    """The kernel module and its attribute whose value routes this engine's projections, or
    RuntimeError."""
    import torch
    from kvfleet.kernels.cpu import cpu_gemm, cpu_gemm_f32

    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        raise RuntimeError(f"needs --device cpu and bfloat16 or float32, got {device} {dtype}")
    if dtype == torch.bfloat16:
        if not cpu_gemm.available():
            raise RuntimeError(
                "no AMX or AVX512-BF16 GEMM on this machine or build: nothing to route in bf16"
            )
        amx = cpu_gemm.kernel() == cpu_gemm.KERNEL_AMX
        return cpu_gemm, "MAX_ROWS" if amx else "VECTOR_MAX_ROWS"
    if not cpu_gemm_f32.available():
        raise RuntimeError("no AVX-512 GEMM in this build: nothing to route in float32")
    return cpu_gemm_f32, "MAX_ROWS"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kvfleet.runtime.bench.throughput import run_engine
    from kvfleet.runtime.bench.workload import standard_workload
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    gemm, limit = routed_kernel(engine.device, engine.dtype)
    dtype = str(engine.dtype).removeprefix("torch.")
    default = DEFAULT_CANDIDATES["float32" if dtype == "float32" else limit]
    candidates = parse_candidates(args.candidates or default)
    workload = standard_workload(
        engine.tokenizer,
        args.num_prompts,
        args.workload_seed,
        vocab_size=engine.model_config.vocab_size,
    )
    paired = PairedForward(engine.model.forward, candidates, gemm, limit)
    engine.model.forward = paired  # an instance attribute: nn.Module.__call__ finds it first
    engine.runner.one_call_shape = None  # every step through the forward it times
    try:
        run = run_engine(engine, workload)
    finally:
        del engine.model.forward
    return {
        "model": config.model,
        "dtype": dtype,
        "kernel": gemm.__name__.rsplit(".", 1)[-1],
        "limit": limit,  # the attribute the candidates set
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "num_prompts": len(workload),
        "candidates": candidates,
        "run_elapsed_s": run.elapsed,  # every compared step ran once per candidate
        **paired.report(),
    }


def run(args: argparse.Namespace) -> int:
    try:
        if args.candidates is not None:
            parse_candidates(args.candidates)  # a bad flag is refused before the model loads
        report = measure(args)
    except (ValueError, RuntimeError) as exc:
        print(f"kvfleet bench gemm-rows: {exc}", file=sys.stderr)
        return 1
    candidates = report["candidates"]
    first = candidates[0]
    print(
        f"model {report['model']} ({report['dtype']}, {report['kernel']}), "
        f"max_num_seqs {report['max_num_seqs']}: "
        f"{report['steps_compared']} steps over {min(candidates)} rows, each run with "
        f"{report['limit']} = {', '.join(map(str, candidates))}"
    )
    for c, seconds in report["forward_s"].items():
        print(f"  MAX_ROWS {c:>5}: forwards {seconds:.2f} s")
    for c, r in report["ratios"].items():
        a = r["all"]
        print(
            f"MAX_ROWS {c} over {first}, per step: median {a['median_ratio']:.3f}, "
            f"faster in {a['faster_steps']} of {a['steps']}"
        )
        for b in r["by_rows"]:
            print(
                f"  rows {b['rows_from']:>5}-{b['rows_to'] if b['rows_to'] < 1 << 30 else '':<5} "
                f"{b['steps']:>4} steps: median {b['median_ratio']:.3f}, faster in "
                f"{b['faster_steps']}"
            )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0
