"""Schemathesis hooks for test_openapi.py's run against `kvfleet serve` (loaded by the CLI through
SCHEMATHESIS_HOOKS): every generated request asks the tiny model for a few tokens at most."""

from __future__ import annotations

from typing import Any

import schemathesis

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_TOKENS = 2
MAX_N = 2
# The largest values the document allows (fields.INT64_MAX, fields.MAX_N; test_openapi checks
# they agree). Kept here as numbers: the CLI imports this module, and the server's would cost
# it seconds.
DOCUMENTED_INT_MAX = 2**63 - 1
DOCUMENTED_MAX_N = 64


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: Any) -> None:
    if case.path in GENERATION_PATHS:
        bound(case.body)


def bound(body: Any) -> None:
    """Clamp what a body asks the model to generate. Only values the document allows are
    clamped, to values it allows: a request built to break a limit still breaks it (and
    schemathesis re-reads what a before_call hook changed)."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if _is_int(body.get(name)) and MAX_TOKENS < body[name] <= DOCUMENTED_INT_MAX:
            body[name] = MAX_TOKENS
    for name in ("n", "best_of"):
        if _is_int(body.get(name)) and MAX_N < body[name] <= DOCUMENTED_MAX_N:
            body[name] = MAX_N
    # The defaults: 16 tokens for a completion, up to max_model_len for a chat.
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
