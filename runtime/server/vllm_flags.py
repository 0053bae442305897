"""vLLM's `vllm serve` flags that kvfleet does not have, as users paste them from vLLM guides
into `kvfleet serve` (or an InferenceService's extraArgs).

Each is either a no-op here (what it asks for is already what kvfleet does: it is accepted and
logged) or unsupported: `kvfleet serve` then exits 2 with one last stderr line naming the flag,
which the operator quotes in the service's Degraded condition. argparse alone would say
"unrecognized arguments", which reads like a typo. Flags kvfleet has are not listed: a flag here
that kvfleet comes to support is served by its own option (register skips it).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# Flag -> why it changes nothing here.
NO_OP_FLAGS: dict[str, str] = {
    "--disable-log-requests": "kvfleet does not log requests",
    "--max-log-len": "kvfleet does not log requests",
    "--disable-log-stats": "kvfleet logs no periodic statistics (they are on /metrics)",
    "--disable-uvicorn-access-log": "kvfleet writes no access log",
    "--trust-remote-code": "kvfleet runs its own model code and never a checkpoint's",
    "--disable-custom-all-reduce": "kvfleet's tensor parallelism uses NCCL's all-reduce only",
}

# Flag -> what to use instead ("" where kvfleet has nothing like it).
UNSUPPORTED_FLAGS: dict[str, str] = {
    # model and loading
    "--tokenizer-mode": "",
    "--tokenizer-revision": "",
    "--code-revision": "",
    "--download-dir": "set $HF_HOME",
    "--load-format": "",
    "--config-format": "",
    "--hf-config-path": "",
    "--hf-overrides": "",
    "--rope-scaling": "",
    "--rope-theta": "",
    "--model-impl": "",
    "--runner": "",
    "--convert": "",
    "--task": "",
    "--max-seq-len-to-capture": "",
    "--max-logprobs": "",
    "--logprobs-mode": "",
    "--disable-sliding-window": "",
    "--disable-cascade-attn": "",
    "--skip-tokenizer-init": "",
    "--enable-prompt-embeds": "",
    "--generation-config": "",
    "--override-generation-config": "",
    "--override-attention-dtype": "",
    "--pooler-config": "",
    "--override-pooler-config": "",
    "--enable-sleep-mode": "",
    "--model-loader-extra-config": "",
    "--ignore-patterns": "",
    "--use-tqdm-on-load": "",
    "--pt-load-map-location": "",
    "--qlora-adapter-name-or-path": "",
    "--logits-processor-pattern": "",
    "--logits-processors": "",
    "--allowed-local-media-path": "",
    # parallelism
    "--pipeline-parallel-size": "use --tensor-parallel-size",
    "-pp": "use --tensor-parallel-size",
    "-tp": "use --tensor-parallel-size",
    "--data-parallel-size": "run more replicas",
    "-dp": "run more replicas",
    "--data-parallel-size-local": "run more replicas",
    "--data-parallel-rank": "run more replicas",
    "--data-parallel-address": "run more replicas",
    "--data-parallel-rpc-port": "run more replicas",
    "--data-parallel-backend": "run more replicas",
    "--data-parallel-hybrid-lb": "run more replicas",
    "--decode-context-parallel-size": "",
    "--enable-expert-parallel": "",
    "--enable-eplb": "",
    "--eplb-config": "",
    "--distributed-executor-backend": "",
    "--max-parallel-loading-workers": "",
    "--ray-workers-use-nsight": "",
    "--worker-cls": "",
    "--worker-extension-cls": "",
    # KV cache and memory
    "--swap-space": "preempted requests are recomputed, never swapped",
    "--cpu-offload-gb": "",
    "--kv-cache-memory-bytes": "use --kv-cache-memory",
    "--num-gpu-blocks-override": "use --kv-cache-memory",
    "--prefix-caching-hash-algo": "",
    "--calculate-kv-scales": "",
    "--kv-sharing-fast-prefill": "",
    "--kv-offloading-size": "",
    "--kv-offloading-backend": "",
    "--mamba-cache-dtype": "",
    "--kv-transfer-config": "",
    "--kv-events-config": "",
    # scheduling and compilation
    "--scheduling-policy": "",
    "--scheduler-cls": "",
    "--num-lookahead-slots": "",
    "--scheduler-delay-factor": "",
    "--max-num-partial-prefills": "use --long-prefill-token-threshold",
    "--max-long-partial-prefills": "use --long-prefill-token-threshold",
    "--cuda-graph-sizes": "",
    "--preemption-mode": "",
    "--num-scheduler-steps": "",
    "--disable-chunked-mm-input": "",
    "--disable-hybrid-kv-cache-manager": "",
    "--compilation-config": "",
    "-O": "",
    "--additional-config": "",
    # structured outputs and reasoning
    "--guided-decoding-backend": "xgrammar is always used",
    "--structured-outputs-config": "xgrammar is always used",
    "--reasoning-parser": "",
    "--enable-reasoning": "",
    # multimodal and LoRA
    "--limit-mm-per-prompt": "",
    "--mm-processor-kwargs": "",
    "--mm-processor-cache-gb": "",
    "--disable-mm-preprocessor-cache": "",
    "--mm-encoder-tp-mode": "",
    "--media-io-kwargs": "",
    "--enable-lora-bias": "",
    "--lora-extra-vocab-size": "",
    "--lora-dtype": "",
    "--fully-sharded-loras": "",
    "--long-lora-scaling-factors": "",
    "--default-mm-loras": "",
    # observability
    "--enable-log-requests": "",
    "--enable-log-outputs": "",
    "--show-hidden-metrics-for-version": "",
    "--otlp-traces-endpoint": "",
    "--collect-detailed-traces": "",
    "--log-config-file": "",
    "--uvicorn-log-level": "use --log-level",
    # the HTTP server
    "--uds": "",
    "--root-path": "",
    "--middleware": "",
    "--allowed-origins": "",
    "--allowed-methods": "",
    "--allowed-headers": "",
    "--allow-credentials": "",
    "--ssl-keyfile": "terminate TLS at the gateway",
    "--ssl-certfile": "terminate TLS at the gateway",
    "--ssl-ca-certs": "terminate TLS at the gateway",
    "--ssl-cert-reqs": "terminate TLS at the gateway",
    "--enable-ssl-refresh": "terminate TLS at the gateway",
    "--chat-template-content-format": "",
    "--response-role": "",
    "--return-tokens-as-token-ids": "",
    "--disable-frontend-multiprocessing": "",
    "--enable-request-id-headers": "",
    "--enable-prompt-tokens-details": "",
    "--enable-server-load-tracking": "",
    "--enable-force-include-usage": "",
    "--enable-tokenizer-info-endpoint": "",
    "--disable-fastapi-docs": "",
    "--tool-parser-plugin": "",
    "--tool-server": "",
    "--exclude-tools-when-tool-choice-none": "",
    "--expand-tools-even-if-tool-choice-none": "",
    "--h11-max-incomplete-event-size": "",
    "--h11-max-header-count": "",
    "--headless": "",
    "--api-server-count": "",
    "--config": "",
    "--prompt-adapters": "",
}

# Where the flags given are kept on the namespace (not an engine or server field).
_DEST = "vllm_flags_given"


class _RecordVllmFlag(argparse.Action):
    """Records the flag: the verdict comes after parsing, so every such flag is named at once."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        # A new tuple each time: the default is shared by every parse.
        setattr(namespace, _DEST, (*getattr(namespace, _DEST, ()), option_string))


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Accept every listed flag the parser lacks (with or without a value), hidden from --help."""
    parser.set_defaults(**{_DEST: ()})
    have = set(parser._option_string_actions)
    for flag in (*NO_OP_FLAGS, *UNSUPPORTED_FLAGS):
        if flag not in have:
            parser.add_argument(
                flag, action=_RecordVllmFlag, nargs="?", dest=_DEST, help=argparse.SUPPRESS
            )


def unsupported_message(given: Sequence[str]) -> str | None:
    """The error for the unsupported flags among `given`, or None when there are none."""
    bad = [flag for flag in dict.fromkeys(given) if flag in UNSUPPORTED_FLAGS]
    if not bad:
        return None
    parts = [
        flag + (f" ({UNSUPPORTED_FLAGS[flag]})" if UNSUPPORTED_FLAGS[flag] else "") for flag in bad
    ]
    which = "this vLLM flag; remove it" if len(bad) == 1 else "these vLLM flags; remove them"
    return f"{'; '.join(parts)}: kvfleet does not support {which} from the command line"


def ignored_flags(given: Sequence[str]) -> list[str]:
    """'flag: why' for each no-op flag among `given`, to log at start."""
    return [f"{flag}: {NO_OP_FLAGS[flag]}" for flag in dict.fromkeys(given) if flag in NO_OP_FLAGS]


def vllm_flags_given(args: argparse.Namespace) -> list[str]:
    """The listed flags on the command line, in order."""
    return list(getattr(args, _DEST, ()))
