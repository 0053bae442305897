"""`kvfleet bench gemm-rows`: where kvfleet's own projection kernel should hand a step's GEMMs
over to the library one, measured on the steps of a real run rather than on one shape. In bf16
that is `cpu_gemm` against oneDNN (the kernel policy's `amx_gemm_max_rows` for its AMX engine,
`avx512_bf16_gemm_max_rows` for its AVX512-BF16 one, whichever runs here: MAX_ROWS and
VECTOR_MAX_ROWS in the report); in float32, the AVX-512 kernel for decode-sized steps against
MKL's F.linear (`f32_gemm_max_rows`, MAX_ROWS in the report).

Runs the standard workload offline (as `bench throughput --baseline none`, same engine flags)
and runs the model's forward of every step that has more rows than the lowest candidate once
per candidate row limit (the model's kernel policy with that limit, swapped in for the run),
back to back, in an order that rotates from step to step: each
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
from dataclasses import replace
from typing import Any

from kvfleet.runtime.bench import kernel_policies
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args

# Keyed by the kernel policy's limit a run moves. AMX: its old and current limits. AVX512-BF16:
# none (oneDNN throughout) and the current limit. float32: none (the kernel once needed 4 rows)
# and the current limit.
DEFAULT_CANDIDATES = {
    "amx_gemm_max_rows": "96,1024",
    "avx512_bf16_gemm_max_rows": "0,1024",
    "f32_gemm_max_rows": "3,128",
}
# The name each limit has in the report (that of the kernel module's constant it once was, so
# reports compare across versions).
REPORTED_LIMIT = {
    "amx_gemm_max_rows": "MAX_ROWS",
    "avx512_bf16_gemm_max_rows": "VECTOR_MAX_ROWS",
    "f32_gemm_max_rows": "MAX_ROWS",
}
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
        f"{DEFAULT_CANDIDATES['amx_gemm_max_rows']}, bf16 on AVX512-BF16 "
        f"{DEFAULT_CANDIDATES['avx512_bf16_gemm_max_rows']}, float32 "
        f"{DEFAULT_CANDIDATES['f32_gemm_max_rows']})",
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
    """Stands in for `model`'s forward (a `LlamaModel`'s, taken when this is made): steps with
    more rows than the lowest candidate run once per candidate (rotating order) and are timed,
    each under the model's kernel policy with its row limit `limit` (a `KernelPolicy` field)
    set to the candidate; the rest run once, untimed, under the model's policy."""

    def __init__(self, model: Any, candidates: list[int], limit: str = "amx_gemm_max_rows") -> None:
        self._model, self._forward = model, model.forward
        base = model.kernels.policy
        self._policies = [replace(base, **{limit: c}) for c in candidates]
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
        out = None
        for i in [(turn + j) % n for j in range(n)]:
            with kernel_policies.running(self._model, self._policies[i]):
                start = time.perf_counter()
                out = self._forward(input_ids, *args, **kwargs)
                times[i] = time.perf_counter() - start
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


def routed_kernel(device: Any, dtype: Any, policy: Any) -> tuple[str, str]:
    """The name of the kernel module that runs this engine's projections under `policy`, and
    the policy's field whose value routes them there, or RuntimeError."""
    import torch
    from kvfleet.kernels.cpu import cpu_gemm, cpu_gemm_f32

    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        raise RuntimeError(f"needs --device cpu and bfloat16 or float32, got {device} {dtype}")
    if dtype == torch.bfloat16:
        if cpu_gemm.kernel(policy) is None:
            raise RuntimeError(
                "no AMX or AVX512-BF16 GEMM on this machine or build: nothing to route in bf16"
            )
        amx = cpu_gemm.kernel(policy) == cpu_gemm.KERNEL_AMX
        return "cpu_gemm", "amx_gemm_max_rows" if amx else "avx512_bf16_gemm_max_rows"
    if not cpu_gemm_f32.available():
        raise RuntimeError("no AVX-512 GEMM in this build: nothing to route in float32")
    return "cpu_gemm_f32", "f32_gemm_max_rows"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kvfleet.runtime.bench.throughput import run_engine
    from kvfleet.runtime.bench.workload import standard_workload
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    model = engine.model
    kernel, limit = routed_kernel(engine.device, engine.dtype, model.kernels.policy)
    dtype = str(engine.dtype).removeprefix("torch.")
    candidates = parse_candidates(args.candidates or DEFAULT_CANDIDATES[limit])
    workload = standard_workload(
        engine.tokenizer,
        args.num_prompts,
        args.workload_seed,
        vocab_size=engine.model_config.vocab_size,
    )
    # Every step through the forward it times: no one-call steps, whatever the candidate.
    own = model.use_kernel_policy(kernel_policies.two_calls(model.kernels.policy))
    paired = PairedForward(model, candidates, limit)
    model.forward = paired  # an instance attribute: nn.Module.__call__ finds it first
    try:
        run = run_engine(engine, workload)
    finally:
        del model.forward
        model.use_kernel_policy(own)
    return {
        "model": config.model,
        "dtype": dtype,
        "kernel": kernel,
        "limit": REPORTED_LIMIT[limit],  # the limit the candidates set
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
