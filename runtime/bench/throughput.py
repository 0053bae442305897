"""`kvfleet bench throughput`: offline throughput of the engine on the standard workload, against
Hugging Face transformers static batching in the same run and dtype, with MFU against this
machine's matmul rate measured in the same run; with --loras N, also the workload spread over N
LoRA adapters against the base model alone."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet.runtime.bench.process_cpu import CpuMeter, descendants
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args

HF_BATCH_SIZE = 32


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "throughput", help="offline throughput vs Hugging Face static batching", description=__doc__
    )
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument(
        "--baseline",
        choices=("hf", "none"),
        default="hf",
        help="hf: transformers generate, batches of 32, padded (takes minutes)",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG of the run's timeline here")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument(
        "--loras",
        type=int,
        default=0,
        help="also run the workload spread evenly over this many random LoRA adapters, and "
        "report its rate against the base model's in the same run",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="the --loras adapters' rank")
    add_engine_args(p)
    p.set_defaults(func=run)


@dataclass(slots=True)
class EngineRun:
    elapsed: float
    prompt_tokens: int
    output_tokens: int
    kv_utilization: float
    contiguous_kv_utilization: float
    peak_running_seqs: int
    preemptions: int
    steps: int
    timeline: dict[str, list[float]] = field(default_factory=dict)
    # CPU seconds of this process (all its threads) and its children (tensor-parallel
    # workers), and the core-seconds the host had (process_cpu.py); None without /proc.
    cpu_seconds: dict[str, float] | None = None


def measure_matmul_flops(dtype: Any, device: Any, size: int = 2048, repeats: int = 10) -> float:
    """Best sustained FLOP/s of a square GEMM in `dtype`: the denominator of MFU. Where the
    engine prepacks its weights (bf16 on CPU), the prepacked GEMM is timed too and the faster
    of the two counts, so prepacking can never flatter MFU."""
    import torch
    from kvfleet.kernels import dispatch

    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    packed = dispatch.prepack_linear_weight(b)
    gemms = [lambda: torch.matmul(a, b)]
    if packed is not b:
        kernels = dispatch.Kernels()  # the engine's default policy: oneDNN at this size
        gemms.append(lambda: kernels.linear(a, packed))
    best = float("inf")
    for gemm in gemms:
        for _ in range(3):
            gemm()
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            gemm()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def run_engine(
    engine: Any, workload: list[Any], temperature: float = 0.0, loras: list[Any] | None = None
) -> EngineRun:
    from kvfleet.runtime.engine.sampling_params import SamplingParams

    # Outside the timed region: first-call allocations, oneDNN kernel selection.
    engine.warm_up()
    engine.kv.reset_prefix_cache()
    preempt0 = engine.scheduler.num_preemptions

    kv, sched, bs = engine.kv, engine.scheduler, engine.kv.block_size
    util, contiguous, running, times = [], [], [], []
    meter = CpuMeter({"engine": [os.getpid(), *descendants(os.getpid())]})
    meter.start()
    start = time.perf_counter()
    for i, item in enumerate(workload):
        params = SamplingParams(
            max_tokens=item.output_len, temperature=temperature, ignore_eos=True, seed=i
        )
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(f"bench-{i}", item.prompt_token_ids, params, lora_request=lora)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        held = sum(r.num_computed_tokens for r in sched.running)
        slots = sum(len(kv.blocks_of(r.request_id)) for r in sched.running) * bs
        if slots:
            util.append(held / slots)
            contiguous.append(held / (len(sched.running) * engine.max_model_len))
        running.append(len(sched.running))
        times.append(time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    cpu = meter.stop()
    return EngineRun(
        elapsed=elapsed,
        prompt_tokens=sum(len(w.prompt_token_ids) for w in workload),
        output_tokens=sum(w.output_len for w in workload),
        kv_utilization=statistics.fmean(util) if util else 0.0,
        contiguous_kv_utilization=statistics.fmean(contiguous) if contiguous else 0.0,
        peak_running_seqs=max(running, default=0),
        preemptions=sched.num_preemptions - preempt0,
        steps=steps,
        timeline={"t": times, "running": running, "kv_utilization": util},
        cpu_seconds=cpu,
    )


def hf_model_for(engine: Any) -> Any:
    """The same weights (or, for random:* models, the same shape) as a transformers model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    folder = engine.model_folder
    if folder is not None:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=engine.dtype)
    else:
        mc = engine.model_config
        cls = Qwen2Config if mc.architecture == "Qwen2ForCausalLM" else LlamaConfig
        cfg = cls(
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_hidden_layers=mc.num_layers,
            num_attention_heads=mc.num_heads,
            num_key_value_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            max_position_embeddings=mc.max_position_embeddings,
            rms_norm_eps=mc.rms_norm_eps,
            tie_word_embeddings=mc.tie_word_embeddings,
        )
        with torch.device(engine.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=engine.dtype)
    return model.to(engine.device).eval()


def run_hf_baseline(engine: Any, workload: list[Any]) -> tuple[float, int]:
    """Static batching: batches of 32 in arrival order, left-padded, each generating until its
    longest request is done. Only requested tokens count as useful output."""
    import torch

    model = hf_model_for(engine)
    pad = engine.tokenizer.pad_token_id
    pad = pad if pad is not None else 0
    useful = 0
    start = time.perf_counter()
    for b in range(0, len(workload), HF_BATCH_SIZE):
        batch = workload[b : b + HF_BATCH_SIZE]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, w in enumerate(batch):
            n = len(w.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(w.prompt_token_ids)
            mask[i, width - n :] = 1
        longest = max(w.output_len for w in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(engine.device),
                attention_mask=mask.to(engine.device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        useful += sum(w.output_len for w in batch)
    return time.perf_counter() - start, useful


def run(args: argparse.Namespace) -> int:
    import torch
    from kvfleet.runtime.bench.workload import standard_workload
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    if args.loras:
        config = dataclasses.replace(
            config,
            enable_lora=True,
            max_loras=max(config.max_loras, args.loras),
            max_lora_rank=max(config.max_lora_rank, args.lora_rank),
        )
    engine = LLMEngine(config)
    workload = standard_workload(
        engine.tokenizer,
        args.num_prompts,
        args.workload_seed,
        vocab_size=engine.model_config.vocab_size,
    )
    print(
        f"device {engine.device}, dtype {engine.dtype}, threads {torch.get_num_threads()}",
        file=sys.stderr,
    )
    # A shared machine's speed drifts (its GEMM rate moved 2x within one run here), so the
    # order is A-B-A: engine, baseline, engine again. kvfleet's figure is the mean of its two
    # runs, which cancels a drift that is linear over the run; the matmul rate is measured at
    # both ends and MFU divides by the higher one, so it is never flattered.
    matmul_first = measure_matmul_flops(engine.dtype, engine.device)
    runs = [run_engine(engine, workload)]
    baseline: tuple[float, int] | None = None
    if args.baseline == "hf":
        baseline = run_hf_baseline(engine, workload)
        runs.append(run_engine(engine, workload))
    matmul_last = measure_matmul_flops(engine.dtype, engine.device)
    matmul = max(matmul_first, matmul_last)
    print(
        f"matmul rate: {matmul_first / 1e12:.3f} TFLOP/s first, {matmul_last / 1e12:.3f} last",
        file=sys.stderr,
    )
    result = runs[0]  # step-level figures (utilization, timeline) come from the first run
    elapsed = statistics.fmean(r.elapsed for r in runs)
    params = engine.model_config.num_parameters()
    # FLOPs a token costs: 2 per weight it multiplies (an untied input embedding is a lookup).
    step_params = engine.model_config.step_parameters()
    total_tps = (result.prompt_tokens + result.output_tokens) / elapsed
    out: dict[str, Any] = {
        "model": config.model,
        "device": _device_name(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "num_prompts": len(workload),
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "kvfleet_elapsed_s": elapsed,
        "kvfleet_elapsed_runs_s": [r.elapsed for r in runs],
        "kvfleet_cpu_seconds": result.cpu_seconds,
        "kvfleet_output_tokens_per_s": result.output_tokens / elapsed,
        "kvfleet_total_tokens_per_s": total_tps,
        "model_parameters": params,
        "matmul_flops": matmul,
        "matmul_flops_first": matmul_first,
        "matmul_flops_last": matmul_last,
        "mfu": total_tps * 2 * step_params / matmul,
        "kv_utilization": result.kv_utilization,
        "contiguous_kv_utilization": result.contiguous_kv_utilization,
        "peak_running_seqs": result.peak_running_seqs,
        "preemptions": sum(r.preemptions for r in runs),
        "steps": result.steps,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "async_scheduling": config.async_scheduling,
    }
    if baseline is not None:
        base_elapsed, useful = baseline
        out["baseline"] = "hf-static-batching-32"
        out["baseline_elapsed_s"] = base_elapsed
        out["baseline_output_tokens_per_s"] = useful / base_elapsed
        out["ratio"] = out["kvfleet_output_tokens_per_s"] / out["baseline_output_tokens_per_s"]
    else:
        out["baseline"] = "none"
        out["baseline_output_tokens_per_s"] = None
        out["ratio"] = None
    if args.loras:
        out.update(_lora_runs(engine, workload, args.loras, args.lora_rank))
    _print_table(out)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        _plot(result, out, args.plot)
    return 0


def _lora_runs(engine: Any, workload: list[Any], count: int, rank: int) -> dict[str, Any]:
    """The workload spread evenly over `count` random rank-`rank` adapters, between two runs of
    the base model alone (A-B-A, as above: the base figure is their mean)."""
    import tempfile

    from kvfleet.runtime.bench.lora_adapters import write_random_adapters

    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-lora-") as folder:
        loras = write_random_adapters(engine.model_config, count, rank, Path(folder))
        base = [run_engine(engine, workload)]
        with_loras = run_engine(engine, workload, loras=loras)
        base.append(run_engine(engine, workload))
    base_tps = with_loras.output_tokens / statistics.fmean(r.elapsed for r in base)
    lora_tps = with_loras.output_tokens / with_loras.elapsed
    print(f"LoRA: {count} adapters of rank {rank}: {lora_tps:.1f} output tokens/s, "
          f"base model {base_tps:.1f} (x{lora_tps / base_tps:.2f})", file=sys.stderr)  # fmt: skip
    return {
        "loras": count,
        "lora_rank": rank,
        "lora_output_tokens_per_s": lora_tps,
        "lora_base_output_tokens_per_s": base_tps,
        "lora_base_elapsed_runs_s": [r.elapsed for r in base],
        "lora_ratio": lora_tps / base_tps,
    }


def _device_name(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def _print_table(out: dict[str, Any]) -> None:
    rows = [
        ("kvfleet output tokens/s", out["kvfleet_output_tokens_per_s"]),
        ("baseline output tokens/s", out["baseline_output_tokens_per_s"]),
        ("ratio", out["ratio"]),
        ("mfu", out["mfu"]),
        ("kv_utilization", out["kv_utilization"]),
        ("contiguous_kv_utilization", out["contiguous_kv_utilization"]),
        ("peak_running_seqs", out["peak_running_seqs"]),
        ("preemptions", out["preemptions"]),
    ]
    print(f"{'metric':<28}{'value':>14}")
    for name, value in rows:
        text = (
            "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        )
        print(f"{name:<28}{text:>14}")


def _plot(result: EngineRun, out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["kvfleet"] + (["HF static (32)"] if out["ratio"] else [])
    values = [out["kvfleet_output_tokens_per_s"]]
    if out["ratio"]:
        values.append(out["baseline_output_tokens_per_s"])
    ax1.bar(names, values, color=["tab:blue", "tab:gray"][: len(values)])
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"{out['model']} · {out['dtype']} · {out['device']}"[:60], fontsize=9)
    t = result.timeline["t"]
    ax2.plot(t, result.timeline["running"], label="running requests")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("running requests")
    ax3 = ax2.twinx()
    ax3.plot(
        t[: len(result.timeline["kv_utilization"])],
        result.timeline["kv_utilization"],
        color="tab:green",
        label="KV utilization",
    )
    ax3.set_ylim(0, 1.05)
    ax3.set_ylabel("KV utilization (held / allocated)")
    ax2.set_title("kvfleet timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
