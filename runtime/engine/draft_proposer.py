"""Draft-model proposals: a small model with the target's tokenizer, on the same device, with
its own paged KV cache, drafts k tokens greedily for every speculating sequence at once.

Each sequence has a shadow `Request` here holding the draft model's view: the target's tokens
plus the drafts last proposed. After verification the drafts the target kept stay computed
(their K/V is the target's tokens'); from the first one it rejected on, the draft model
computes again. So a round is one forward over every sequence's new tokens (usually the
correction and one accepted draft), then k - 1 one-token decode steps.

Greedy drafts are point masses: the sampler's rejection sampling (p(d) to accept) keeps the
output distribution exactly the target's at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kvfleet.kernels import dispatch
from kvfleet.runtime.engine.config import ConfigError
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.model_runner import ModelRunner, kv_bytes_per_token
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.scheduler import ScheduledBatch
from kvfleet.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
MAX_CATCH_UP_ROWS = 8


@dataclass(slots=True)
class DraftModel:
    """The draft model's weights, loaded before the KV budget is read (its cache shares it)."""

    model: torch.nn.Module
    config: ModelConfig
    kv_bytes_per_token: int


def load_draft(core: EngineCore) -> DraftModel:
    """Load `speculative_config.model` like the model itself (dtype, device, kernel policy),
    checked to share the model's vocabulary and to reach its max_model_len."""
    from kvfleet.runtime.models.loader import load_model

    config, spec = core.config, core.config.speculative_config
    assert spec is not None and spec.model is not None
    model, mc, _ = load_model(
        spec.model, core.dtype, core.device, spec.revision, config.hf_token,
        policy=config.kernel_policy, quantization=spec.quantization,
    )  # fmt: skip
    target = core.model_config
    if mc.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative_config.model: the draft's vocabulary has {mc.vocab_size} tokens, "
            f"the model's {target.vocab_size}; a draft must share the model's tokenizer"
        )
    if mc.max_position_embeddings < core.max_model_len:
        raise ConfigError(
            f"speculative_config.model: the draft's context is {mc.max_position_embeddings} "
            f"tokens, below max_model_len {core.max_model_len}; lower --max-model-len"
        )
    model.prepack()
    per_token = kv_bytes_per_token(mc, core.kv_dtype, model.layout.num_kv_heads)
    return DraftModel(model, mc, per_token)


class DraftProposer:
    """The draft model's KV cache and runner, and each sequence's shadow request."""

    def __init__(self, draft: DraftModel, core: EngineCore) -> None:
        config = core.config
        self.model = draft.model
        # As many tokens as the model's cache holds (the budget was split between the two):
        # a sequence the model can run, the draft can follow (prefix sharing aside).
        self.kv = KVCacheManager(core.kv.num_blocks, core.kv.block_size, False)
        graphs = core.device.type == "cuda" and not config.enforce_eager
        self.runner = ModelRunner(
            draft.model, draft.config, self.kv, core.kv_dtype, core.device,
            graph_max_batch=config.max_num_seqs if graphs else 0,
            max_model_len=core.max_model_len, max_num_seqs=config.max_num_seqs,
        )  # fmt: skip
        self.seqs: dict[str, Request] = {}
        self._base: dict[str, int] = {}  # request id → its length when drafts were proposed
        # Prompt tokens the draft computes per round, as the model's steps are bounded: a long
        # prompt is caught up in chunks, its sequence drafting once it is whole.
        self.prefill_budget = config.max_num_batched_tokens

    def propose(self, wanted: list[tuple[Request, int]]) -> None:
        """Set `spec_token_ids` of each (request, k): k greedy draft tokens."""
        batch = ScheduledBatch()
        rounds: list[tuple[Request, Request, int]] = []
        budget = self.prefill_budget
        for r, k in wanted:
            d = self._catch_up(r)
            n = d.num_tokens - d.num_computed_tokens
            whole = n <= MAX_CATCH_UP_ROWS or n <= budget
            if not whole:  # a chunk of a long prompt (never catch-up sized): no drafts yet
                n = budget if budget > MAX_CATCH_UP_ROWS else 0
            if n > MAX_CATCH_UP_ROWS:
                budget -= n
            if n == 0:
                continue
            if not self.kv.allocate_slots(d, n):
                self.free(r)  # its cache is wanted by others; it drafts again later
                continue
            batch.requests.append(d)
            batch.num_tokens.append(n)
            if whole:
                rounds.append((r, d, k))
        for step in range(max((k for _, _, k in rounds), default=1)):
            if not batch:
                break
            self._run(batch)
            batch = ScheduledBatch()
            for _, d, k in rounds:
                if step + 1 < k and self.kv.allocate_slots(d, 1):
                    batch.requests.append(d)
                    batch.num_tokens.append(1)
        for r, d, k in rounds:
            base = r.num_tokens
            r.spec_token_ids = d.all_token_ids[base : base + k]
            self._base[r.request_id] = base

    def free(self, r: Request) -> None:
        d = self.seqs.pop(r.request_id, None)
        self._base.pop(r.request_id, None)
        if d is not None:
            self.kv.free(d)

    def _catch_up(self, r: Request) -> Request:
        """r's shadow, holding r's tokens, computed as far as they agree with what it drafted."""
        d = self.seqs.get(r.request_id)
        if d is None:
            d = Request(r.request_id, r.prompt_token_ids, _GREEDY, frozenset(), 1 << 30)
            d.all_token_ids = r.all_token_ids[:]
            self.seqs[r.request_id] = d
            return d
        base = self._base.get(r.request_id)
        if base is None:  # its prompt is still being caught up, chunk by chunk
            d.all_token_ids = r.all_token_ids[:]
            return d
        valid = base
        tokens, drafted = r.all_token_ids, d.all_token_ids
        while valid < min(len(tokens), len(drafted)) and tokens[valid] == drafted[valid]:
            valid += 1
        d.num_computed_tokens = min(d.num_computed_tokens, valid)
        d.all_token_ids = tokens[:]
        return d

    def _run(self, batch: ScheduledBatch) -> None:
        """One draft forward: each sequence's next greedy token appended to it. A catch-up of a
        few tokens runs as decode rows, one per token (the runner's form for draft tokens),
        not as a prompt chunk: the prefill path's per-sequence attention costs more than the
        rows' extra logits at these lengths."""
        tails: dict[int, list[int]] = {}
        for d, n in zip(batch.requests, batch.num_tokens, strict=True):
            if 1 < n <= MAX_CATCH_UP_ROWS:
                cut = d.num_computed_tokens + 1
                d.spec_token_ids = tails[id(d)] = d.all_token_ids[cut:]
                del d.all_token_ids[cut:]
        try:
            result = self.runner.execute(batch)
        finally:
            for d in batch.requests:
                if id(d) in tails:
                    d.all_token_ids.extend(tails[id(d)])
                    d.spec_token_ids = []
        tokens = result.argmax
        if tokens is None:  # (a step of prompt chunks only samples no row)
            tokens = dispatch.argmax(result.logits).tolist() if result.sample_rows else []
        last = {id(d): (d, t) for d, t in zip(result.sample_rows, tokens, strict=True)}
        for d, n in zip(batch.requests, batch.num_tokens, strict=True):
            d.num_computed_tokens += n
        for d, token in last.values():  # a sequence's last row predicts its next token
            d.all_token_ids.append(token)
