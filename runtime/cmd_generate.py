"""`kvfleet generate`: one prompt through the engine, the completion on stdout."""

from __future__ import annotations

import argparse
import sys

from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Generate a completion for one prompt and print it.",
    )
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.engine.sampling_params import SamplingParams

    try:
        config = engine_config_from_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,  # --seed: same seed, same text
        )
        with LLM(config) as llm:  # closing stops tensor-parallel workers, if any
            if args.chat:
                out = llm.chat([{"role": "user", "content": args.prompt}], params)
            else:
                out = llm.generate(args.prompt, params)
    except ValueError as e:  # config, model, sampling and request errors all are: bad input
        print(f"kvfleet generate: error: {e}", file=sys.stderr)
        return 2
    print(out[0].outputs[0].text)
    return 0
