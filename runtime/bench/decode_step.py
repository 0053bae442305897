"""`kvfleet bench decode-step`: one decode step of the model, run op by op (six kernel calls per
layer from Python), with the decoder stack as one fused C call (`kvfleet.kernels.cpu.
cpu_decode_step`; the embedding, final norm and LM head still from Python), and as one call
from token ids to logits (`cpu_decode_logits`, what the engine runs for decode steps of up to
16 sequences), at several batch sizes, in one run. With `--prompt-tokens N` each step also
carries a prompt chunk of N tokens after its decodes (a serving step that admits a request):
op by op against the fused call, which runs such steps too (no one-call form).

Each batch size first checks that the paths give the same logits to the bit (all run every
projection on the same GEMM kernel: `cpu_gemm` in bfloat16, `cpu_gemm_f32` or the 4-bit kernel
in float32), then times them in turns. Times are the minimum and median over `--iters` steps
each, logits included. CPU only; `--dtype auto` is the CPU's default (bfloat16 where it is
native, else float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

from kvfleet.kernels.policy import DEFAULT_POLICY

# bf16: up to cpu_gemm.max_rows(policy) sequences (the policy's AMX or AVX512-BF16 limit);
# float32: cpu_gemm_f32.min_rows() to the policy's f32_gemm_max_rows.
DEFAULT_SEQUENCES = {"bfloat16": "1,8,32,128", "float32": "1,8,32,128"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode-step",
        help="a decode step op by op vs one fused C call (CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bundled", help="as for `kvfleet generate` (default bundled)")
    p.add_argument(
        "--sequences",
        default=None,
        help="batch sizes to time, comma-separated (default: bfloat16 "
        f"{DEFAULT_SEQUENCES['bfloat16']}, float32 {DEFAULT_SEQUENCES['float32']})",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the model's dtype (default auto: the CPU's default)",
    )
    p.add_argument("--context", type=int, default=400, help="tokens each sequence has cached")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="a prompt chunk of this many tokens (after --context cached ones) in each step",
    )
    p.add_argument("--iters", type=int, default=20, help="timed steps per path and batch size")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.set_defaults(func=run)


@dataclass(slots=True)
class StepRow:
    sequences: int
    context_tokens: int
    prompt_tokens: int
    per_op_min_ms: float
    per_op_median_ms: float
    fused_min_ms: float
    fused_median_ms: float
    speedup_median: float  # per-op median over fused median
    # The one-call step's (decode-only steps; None with a prompt chunk).
    one_call_min_ms: float | None
    one_call_median_ms: float | None
    one_call_speedup_median: float | None  # fused (two calls) median over one-call median


def _parse_sequences(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--sequences: comma-separated counts of at least 1, got {text!r}")
    return counts


class _Batch:
    """`sequences` decoding sequences of `context` cached tokens each, and a sequence whose
    `prompt` next tokens are a chunk of its prompt (none where 0), in consecutive blocks of
    head-major caches filled with random K/V."""

    def __init__(
        self, torch, net, config, sequences: int, context: int, prompt: int, dtype
    ) -> None:
        from kvfleet.kernels.metadata import AttentionMetadata

        block = 16
        per_seq = (context + prompt) // block + 1
        num_seqs = sequences + (prompt > 0)
        gen = torch.Generator().manual_seed(sequences)
        self.kv = []
        for _ in range(config.num_layers):
            k, v = net.kernels.allocate_kv_cache(
                num_seqs * per_seq, block, config.num_kv_heads, config.head_dim,
                dtype, torch.device("cpu"),
            )  # fmt: skip
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))
            self.kv.append((k, v))
        tables = torch.arange(num_seqs * per_seq, dtype=torch.int32).reshape(num_seqs, per_seq)
        # Each sequence's positions this step: its next token's, or the chunk's.
        q_lens = [1] * sequences + [prompt] * (prompt > 0)
        positions = torch.cat([torch.arange(context, context + n) for n in q_lens])
        rows = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(q_lens))
        slots = tables[rows, positions // block].long() * block + positions % block
        lens = [context + n for n in q_lens]
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=slots.contiguous(),
            num_decodes=sequences,
            max_query_len=max(q_lens),
            max_seq_len=max(lens),
            query_lens_host=q_lens,
            seq_lens_host=lens,
        )
        self.rows = len(positions)
        self.ids = torch.randint(0, config.vocab_size, (self.rows,), generator=gen)
        self.positions = positions
        self.net = net
        # The one-call step's inputs: the same step as Python lists.
        self.lists = (
            self.ids.tolist(), self.positions.tolist(), slots.tolist(), lens, tables.tolist(),
        )  # fmt: skip
        stack = net.build_decode_stack(self.kv)
        self.stack = stack
        self.one_call = (
            None if stack is None or prompt else net.build_decode_logits(stack, sequences, per_seq)
        )

    def step(self):
        """The step's final hidden states and logits (K/V rewritten to the same slots)."""
        hidden = self.net(self.ids, self.positions, self.kv, self.meta, self.stack)
        return hidden, self.net.compute_logits(hidden)

    def step_one_call(self):
        """The step's logits from the one call, under the model's kernel policy."""
        logits, _ = self.one_call.run(*self.lists, policy=self.net.kernels.policy)
        return logits


def _row(torch, batch: _Batch, n: int, context: int, prompt: int, iters: int) -> StepRow:
    """Check the paths give the same bits, then time them in turns: the model's own kernel
    policy runs the fused and one-call steps, the same policy with the fused step off the
    per-op one."""
    net = batch.net
    fused_policy = net.kernels.policy
    policies = {
        "per-op": replace(fused_policy, fused_decode_step=False),
        "fused": fused_policy,
    }
    if batch.one_call is not None:
        policies["one call"] = fused_policy
    try:
        fused, _ = batch.step()
        if batch.one_call is not None:
            one_call_logits = batch.step_one_call().clone()
        net.use_kernel_policy(policies["per-op"])
        per_op, per_op_logits = batch.step()
        if not torch.equal(fused, per_op):
            raise RuntimeError(f"fused step at {n} sequences: not the per-op bits")
        if batch.one_call is not None and not torch.equal(one_call_logits, per_op_logits):
            raise RuntimeError(f"one-call decode step at {n} sequences: not the per-op logits")
        paths = tuple(policies)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for i in range(len(paths) * iters):
            path = paths[i % len(paths)]
            net.use_kernel_policy(policies[path])
            start = time.perf_counter()
            batch.step_one_call() if path == "one call" else batch.step()
            times[path].append((time.perf_counter() - start) * 1e3)
    finally:
        net.use_kernel_policy(fused_policy)
    medians = {p: statistics.median(t) for p, t in times.items()}
    one_call = times.get("one call")
    return StepRow(
        sequences=n,
        context_tokens=context,
        prompt_tokens=prompt,
        per_op_min_ms=min(times["per-op"]),
        per_op_median_ms=medians["per-op"],
        fused_min_ms=min(times["fused"]),
        fused_median_ms=medians["fused"],
        speedup_median=medians["per-op"] / medians["fused"],
        one_call_min_ms=min(one_call) if one_call else None,
        one_call_median_ms=medians["one call"] if one_call else None,
        one_call_speedup_median=medians["fused"] / medians["one call"] if one_call else None,
    )


def measure(
    model: str,
    sequences: list[int],
    context: int,
    iters: int,
    dtype_name: str,
    prompt: int = 0,
) -> dict:
    """A row per batch size (`sequences`, each step with a `prompt`-token chunk where not 0) of
    the model in `dtype_name`, each checked for the same bits first; RuntimeError where the
    fused call does not take a step here."""
    import torch
    from kvfleet.runtime.engine.device import resolve_dtype
    from kvfleet.runtime.models.loader import load_model

    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    net, config, _ = load_model(model, dtype, "cpu", policy=DEFAULT_POLICY)
    net.prepack()
    rows: list[StepRow] = []
    with torch.inference_mode():
        for n in sequences:
            batch = _Batch(torch, net, config, n, context, prompt, dtype)
            if not _fused_takes(batch, prompt):
                needs = "AMX or AVX512-BF16" if dtype == torch.bfloat16 else "AVX-512 or AVX2"
                if batch.stack is not None:
                    lo, hi = batch.stack.row_range(DEFAULT_POLICY)
                    needs += f", and {lo} to {hi} rows a step, {batch.rows} here"
                chunk = f" and a {prompt}-token chunk" if prompt else ""
                raise RuntimeError(
                    f"no fused decode step here for {n} sequences{chunk} in {dtype_name} "
                    f"({str(dtype).removeprefix('torch.')}: needs {needs})"
                )
            rows.append(_row(torch, batch, n, context, prompt, iters))
            del batch  # its caches: the next batch size allocates its own
    return {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "same_bits": True,  # every row, before timing (else the command fails)
        "rows": [asdict(r) for r in rows],
    }


def _fused_takes(batch: _Batch, prompt: int) -> bool:
    """Whether the fused call (and for a decode-only step the one call) takes the batch's step."""
    stack = batch.stack
    if stack is None or not stack.accepts(batch.meta, batch.rows, DEFAULT_POLICY):
        return False
    return bool(prompt) or batch.one_call is not None


def _default_sequences(dtype_name: str) -> str:
    """The defaults the fused call takes here (the AVX512-BF16 engine takes fewer rows than
    AMX's)."""
    from kvfleet.kernels.cpu import cpu_features, cpu_gemm

    if dtype_name == "auto":
        dtype_name = "bfloat16" if cpu_features.native_bf16() else "float32"
    counts = _parse_sequences(DEFAULT_SEQUENCES[dtype_name])
    if dtype_name == "bfloat16" and cpu_gemm.available():
        counts = [n for n in counts if n <= cpu_gemm.max_rows(DEFAULT_POLICY)]
    return ",".join(map(str, counts))


def run(args: argparse.Namespace) -> int:
    try:
        if args.context < 1 or args.iters < 1:
            raise ValueError("--context and --iters: must be at least 1")
        if args.prompt_tokens < 0:
            raise ValueError(f"--prompt-tokens: must be at least 0, got {args.prompt_tokens}")
        sequences = _parse_sequences(args.sequences or _default_sequences(args.dtype))
        report = measure(
            args.model,
            sequences,
            args.context,
            args.iters,
            args.dtype,
            args.prompt_tokens,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"kvfleet bench decode-step: {exc}", file=sys.stderr)
        return 1
    step = "decode step" + (
        f" with a {args.prompt_tokens}-token chunk" if args.prompt_tokens else ""
    )
    print(
        f"model {report['model']} ({report['dtype']}), {report['threads']} threads; "
        f"{step}, ms (min / median)"
    )
    print(
        f"{'seqs':>5} {'context':>8} {'per-op':>16} {'fused':>16} {'speedup':>8} "
        f"{'one call':>16} {'over fused':>10}"
    )
    for r in report["rows"]:
        one_call = (
            f"{r['one_call_min_ms']:>7.2f} / {r['one_call_median_ms']:>6.2f} "
            f"{r['one_call_speedup_median']:>9.2f}x"
            if r["one_call_median_ms"] is not None
            else f"{'-':>16} {'-':>10}"
        )
        print(
            f"{r['sequences']:>5} {r['context_tokens']:>8} "
            f"{r['per_op_min_ms']:>7.2f} / {r['per_op_median_ms']:>6.2f} "
            f"{r['fused_min_ms']:>7.2f} / {r['fused_median_ms']:>6.2f} "
            f"{r['speedup_median']:>7.2f}x {one_call}"
        )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0
