"""Owns the model and the KV cache tensors; turns a scheduled batch into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.request import Request, TokenLogprob
from kvfleet.runtime.engine.scheduler import ScheduledBatch
from kvfleet.runtime.models.config import ModelConfig

# Prompt logprobs turn hidden rows into full-vocabulary logits; this many at a time bounds the
# memory that costs (a long prompt chunk times a large vocabulary would not fit otherwise).
PROMPT_LOGITS_ROWS = 256


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    """K and V, every layer: what one cached token costs."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem


@dataclass(slots=True)
class StepLogits:
    """What one forward pass hands the engine."""

    sample_rows: list[Request]  # the requests that now need a sampled token
    logits: torch.Tensor  # their float32 last-token logits [len(sample_rows), vocab], on CPU
    # Prompt logprobs this step computed, per request that asked, in prompt order.
    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)


@dataclass(slots=True)
class _PromptSpan:
    """Positions [lo, hi) of `request`, at hidden rows from `first_row`, owe prompt logprobs."""

    request: Request
    first_row: int
    lo: int
    hi: int


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv: KVCacheManager,
        kv_dtype: torch.dtype,  # the cache's: the model's, or fp8 (--kv-cache-dtype)
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.kv_caches = [
            dispatch.allocate_kv_cache(
                kv.num_blocks,
                kv.block_size,
                model_config.num_kv_heads,
                model_config.head_dim,
                kv_dtype,
                device,
            )
            for _ in range(model_config.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """Run every scheduled token; return the logits of the requests that now need a
        sampled token, and the prompt logprobs owed by the scheduled positions."""
        bs = self.kv.block_size
        order = [i for i, n in enumerate(batch.num_tokens) if n == 1]
        num_decodes = len(order)
        order += [i for i, n in enumerate(batch.num_tokens) if n != 1]

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[Request] = []
        logits_index: list[int] = []
        prompt_spans: list[_PromptSpan] = []
        for i in order:
            r = batch.requests[i]
            n = batch.num_tokens[i]
            start = r.num_computed_tokens
            end = start + n
            blocks = self.kv.blocks_of(r.request_id)
            owed = r.prompt_logprob_position
            if owed is not None:
                # Position p's logits score prompt token p + 1; the last prompt position's
                # logits are for sampling. A recompute after preemption owes nothing twice.
                lo, hi = max(start, owed), min(end, r.num_prompt_tokens - 1)
                if lo < hi:
                    prompt_spans.append(_PromptSpan(r, len(input_ids) + lo - start, lo, hi))
            if n == 1:
                input_ids.append(r.all_token_ids[start])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                input_ids.extend(r.all_token_ids[start:end])
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(blocks)[pos // bs] * bs + pos % bs).tolist())
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(blocks)
            if end == r.num_tokens:
                sample_rows.append(r)
                logits_index.append(len(input_ids) - 1)

        max_blocks = max(len(t) for t in tables)
        table = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for row, t in enumerate(tables):
            table[row, : len(t)] = t
        dev = self.device
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        prompt_logprobs = [(s.request, self._prompt_logprobs(hidden, s)) for s in prompt_spans]
        if not sample_rows:
            return StepLogits([], torch.empty(0), prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(logits_index, device=dev)])
        return StepLogits(sample_rows, logits.float().cpu(), prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, span: _PromptSpan) -> list[TokenLogprob]:
        """log_softmax (float32) at each position of the span, gathered at the next prompt
        token, with the top-k alternatives; only these small results leave the device."""
        r = span.request
        k = r.params.prompt_logprobs or 0
        targets = r.prompt_token_ids[span.lo + 1 : span.hi + 1]
        target_ids = torch.tensor(targets, dtype=torch.long, device=self.device)
        entries: list[TokenLogprob] = []
        for s in range(0, len(targets), PROMPT_LOGITS_ROWS):
            e = min(s + PROMPT_LOGITS_ROWS, len(targets))
            rows = hidden[span.first_row + s : span.first_row + e]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            chosen = logprobs.gather(1, target_ids[s:e, None]).squeeze(1).tolist()
            if k:
                vals, ids = logprobs.topk(k, dim=-1)
                tops = [
                    list(zip(i, v, strict=True))
                    for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
                ]
            else:
                tops = [[] for _ in chosen]
            entries.extend(
                TokenLogprob(t, lp, top)
                for t, lp, top in zip(targets[s:e], chosen, tops, strict=True)
            )
        return entries
