"""The limits a request must fit before the engine takes it: the checks that need the model
(its vocabulary, max_model_len) on top of SamplingParams' own. Torch-free, so the HTTP server
can name the failing field without loading the engine."""

from __future__ import annotations

from kvfleet.runtime.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int
) -> int:
    """Refuse (RequestError) what the engine cannot run; return the resolved max_tokens."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("prompt", "must not be empty")
    if n >= max_model_len:
        raise RequestError(
            "prompt",
            f"has {n} tokens; max_model_len is {max_model_len} and at least one token "
            f"must be generated",
        )
    if any(t < 0 or t >= vocab for t in prompt_token_ids):
        raise RequestError("prompt", f"token ids must be in [0, {vocab})")
    if params.top_k > vocab:
        raise RequestError(
            "top_k",
            f"must be at most the model's vocabulary size {vocab} (or 0 / -1 for no limit), "
            f"got {params.top_k}",
        )
    # The sampler indexes each logits row with these ids: one past the vocabulary would raise
    # in the engine thread and stop the engine for every request, so refuse it here.
    too_big = [t for t in params.logit_bias if t >= vocab]
    if too_big:
        raise RequestError(
            "logit_bias",
            f"token id {too_big[0]} is out of range: must be < the model's vocabulary size {vocab}",
        )
    too_big = [t for t in params.stop_token_ids if t < 0 or t >= vocab]
    if too_big:
        raise RequestError(
            "stop_token_ids",
            f"token id {too_big[0]} is out of range: must be in [0, {vocab})",
        )
    max_tokens = params.max_tokens or (max_model_len - n)
    if n + max_tokens > max_model_len:
        raise RequestError(
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
            f"max_model_len {max_model_len}",
        )
    return max_tokens
