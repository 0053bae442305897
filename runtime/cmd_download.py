"""`kvfleet download`: fetch a model into the cache before anything serves it — what a pod's
init step runs, so that the server container starts with the weights on disk."""

from __future__ import annotations

import argparse
import logging
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download",
        help="fetch a Hub model (or convert the bundled one) into the cache",
        description="Fetch a model into the cache and print its folder: a Hub id (org/name) "
        "goes to the Hugging Face cache ($HF_HOME/hub; config, tokenizer and safetensors "
        "files only, resumed if interrupted); 'bundled' or a .gguf file is converted once "
        "into kvfleet's cache. A later `kvfleet serve --model` of the same value (and "
        "--revision) loads from there, with HF_HUB_OFFLINE=1 if you like.",
    )
    p.add_argument("--model", required=True, help="a Hub id (org/name), 'bundled' or a .gguf file")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.add_argument(
        "--hf-token", default=None, help="token for gated or private models (default: $HF_TOKEN)"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfleet.runtime.models import hub
    from kvfleet.runtime.models.errors import ModelLoadError

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if hub.is_hub_id(args.model):
            folder = hub.download_model(args.model, args.revision, args.hf_token)
        else:  # converting a GGUF needs torch and transformers: only then are they loaded
            from kvfleet.runtime.models.model_files import resolve_model

            folder = resolve_model(args.model)
    except ModelLoadError as exc:
        print(f"kvfleet download: error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0
