"""What a host's steps cost, read from a `--step-log`: the engine's step-time model (step_time.py)
fitted to every step of a run, none of them fading, instead of to the last hundred or so as
the scheduler keeps it.

    kvfleet bench serve --spawn --long-prompt-every 8 --concurrency 8 \\
        --serve-args "--step-log steps.jsonl"
    python -m kvfleet.runtime.bench.step_log_fit steps.jsonl

prints a decode-only step as a fixed part plus a cost per row, and what prompt chunks add to a
step as a fixed part (leaving the decode-only path), a cost per prompt token and one per token
of context those attend to — the figures the scheduler sizes prompt shares by, and those of the
simulated host in tests/runtime/test_prompt_pace.py. Several files are read as one run;
`--split-at-gap S` fits apart the runs a log holds, where no step ran for more than S seconds
(`bench serve`'s scenarios start one server per setting, all appending to the one file).

usage: step_log_fit FILE [FILE ...] [--split-at-gap S] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvfleet.runtime.engine.step_log import read_step_log
from kvfleet.runtime.engine.step_time import StepTimeModel, WeightedFit, WeightedLine


def fit_steps(steps: list[dict[str, Any]]) -> StepTimeModel:
    """The step-time model fitted to `steps`, every step weighing alike: decode-only steps
    first, so that each step with prompt tokens is measured against the whole run's decode
    line rather than against the steps before it."""
    model = StepTimeModel(WeightedLine(decay=1.0), WeightedFit(decay=1.0))
    decode_only = [s for s in steps if s["prompt_tokens"] == 0]
    for s in decode_only + [s for s in steps if s["prompt_tokens"] > 0]:
        model.observe(s["prompt_tokens"], s["decode_rows"], s["seconds"], s["context"])
    return model


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The fit and the counts behind it, in seconds."""
    model = fit_steps(steps)
    decode = model.decode.fit(min_spread=0.5)
    cost = model.prompt_cost()
    mixed = [s for s in steps if s["prompt_tokens"] > 0 and s["decode_rows"] > 0]
    return {
        "steps": len(steps),
        "decode_only_steps": sum(1 for s in steps if s["prompt_tokens"] == 0),
        "mixed_steps": len(mixed),
        "prompt_only_steps": sum(1 for s in steps if s["decode_rows"] == 0),
        "seconds": sum(s["seconds"] for s in steps),
        "decode_fixed_s": decode[0] if decode else None,
        "decode_per_row_s": decode[1] if decode else None,
        "prompt_fixed_s": cost.fixed if cost else None,
        "prompt_per_token_s": cost.per_token if cost else None,
        "prompt_per_context_s": cost.per_context if cost else None,
    }


def split_runs(steps: list[dict[str, Any]], gap: float) -> list[list[dict[str, Any]]]:
    """`steps` cut wherever more than `gap` seconds pass between one step's end and the next's
    (a step's `time` is when it ended)."""
    runs: list[list[dict[str, Any]]] = []
    for step in steps:
        if not runs or step["time"] - step["seconds"] - runs[-1][-1]["time"] > gap:
            runs.append([])
        runs[-1].append(step)
    return runs


def _ms(seconds: float | None, scale: float = 1e3) -> str:
    return "-" if seconds is None else f"{seconds * scale:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="step_log_fit", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="--step-log files of one run")
    p.add_argument(
        "--split-at-gap",
        type=float,
        metavar="S",
        help="fit each run apart, a run ending where no step ran for more than S seconds",
    )
    p.add_argument("--json", metavar="OUT", help="also write the summaries as JSON to OUT")
    args = p.parse_args(argv)
    steps = [s for path in args.files for s in read_step_log(path)]
    if not steps:
        print(f"step_log_fit: error: no steps in {', '.join(args.files)}", file=sys.stderr)
        return 1
    runs = split_runs(steps, args.split_at_gap) if args.split_at_gap else [steps]
    summaries = [summary(run) for run in runs]
    for i, s in enumerate(summaries):
        if len(runs) > 1:
            print(f"run {i + 1} of {len(runs)}:")
        _print(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries if len(runs) > 1 else summaries[0], f, indent=2)
    return 0


def _print(s: dict[str, Any]) -> None:
    print(
        f"{s['steps']} steps, {s['seconds']:.2f} s: {s['decode_only_steps']} decode-only, "
        f"{s['mixed_steps']} mixed, {s['prompt_only_steps']} with prompts alone"
    )
    print(
        f"decode-only step: {_ms(s['decode_fixed_s'])} ms + {_ms(s['decode_per_row_s'])} ms a row"
    )
    print(
        f"prompt tokens add: {_ms(s['prompt_fixed_s'])} ms + {_ms(s['prompt_per_token_s'])} ms "
        f"a token + {_ms(s['prompt_per_context_s'], 1e6)} us a token of context"
    )


if __name__ == "__main__":
    sys.exit(main())
